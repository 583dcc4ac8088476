"""Pipeline schedules as plain lists of actions, the same for every framework.

A schedule for ``p`` stages and ``m`` micro-batches gives each stage the
ordered list of what it does: ``Action("F", i)`` (forward of micro-batch i:
receive its input from stage s-1 unless first, run, send the output to
stage s+1 unless last) and ``Action("B", i)`` (backward of micro-batch i:
receive the output gradient from stage s+1 unless last, run, send the input
gradient to stage s-1 unless first).

* GPipe (Huang et al. 2019): all m forwards, then all m backwards.  Every
  stage holds the activations of all m micro-batches at once.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs
  ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards.  At most ``p - s``
  micro-batches are in flight on stage s, so activation memory is bounded by
  the pipeline depth instead of m.  One change: the first stage (of ``p > 1``)
  runs one more warm-up forward, so it holds ``min(p + 1, m)``.  Its backward
  sends nothing, so running the next forward first delays nobody, while the
  textbook order (backward of i, then forward of i + p) puts the message
  round trip to stage 1 and back on the critical path of every cycle: at
  p = 2, stage 1 waited two message latencies per micro-batch for its next
  input.

Both have the same bubble: the idle fraction of an ideal pipeline of equal
stages is ``(p - 1) / (m + p - 1)``.  Sends are asynchronous and receives
are posted in schedule order, so neither schedule deadlocks.
"""
from __future__ import annotations

from typing import List, NamedTuple

__all__ = ["Action", "gpipe", "one_f_one_b", "SCHEDULES", "schedule", "bubble_fraction"]


class Action(NamedTuple):
    """One step of a stage's schedule: ``kind`` "F" or "B" of micro-batch ``micro``."""

    kind: str
    micro: int


def _check(stages: int, micro_batches: int, stage: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"need at least one stage and one micro-batch, got {stages} and {micro_batches}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} outside 0..{stages - 1}")


def gpipe(stages: int, micro_batches: int, stage: int) -> List[Action]:
    """GPipe: F0 F1 ... F(m-1) B(m-1) ... B0 on every stage."""
    _check(stages, micro_batches, stage)
    m = micro_batches
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in reversed(range(m))]


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> List[Action]:
    """1F1B: warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    _check(stages, micro_batches, stage)
    m = micro_batches
    warm = min(stages - stage - 1 + (stage == 0 and stages > 1), m)
    actions = [Action("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        actions.append(Action("F", f))
        f += 1
        actions.append(Action("B", b))
        b += 1
    actions += [Action("B", i) for i in range(b, m)]
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def schedule(name: str, stages: int, micro_batches: int, stage: int) -> List[Action]:
    """The actions of ``stage`` under the schedule ``name`` ("gpipe" or "1f1b")."""
    fn = SCHEDULES.get(name)
    if fn is None:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    return fn(stages, micro_batches, stage)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle fraction of an ideal pipeline: ``(p - 1) / (m + p - 1)``."""
    return (stages - 1) / (micro_batches + stages - 1)
