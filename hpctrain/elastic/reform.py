"""Re-form the world from the survivors of a failure (elastic mode, MPI's fault-tolerance extension ULFM).

After ranks failed, every survivor's collectives raise
:class:`~hpctrain.errors.WorldFailedError` (the runtime revoked the old
world's communicators, so none stays blocked).  :func:`reform`, called by every
survivor, then:

1. shrinks the old world's MPI communicator to the survivors
   (``MPI_Comm_shrink``: one fault-tolerant agreement, a few milliseconds;
   a rank that fails during it is left out too);
2. stops the old world on this rank without talking to anyone (its lanes and
   watchdog; its windows and communicators are kept, unfreed: :func:`discard`);
3. builds a new world communicator over the survivors (new ranks ``0..n-1`` in
   the old order: the lowest surviving rank is the new rank 0), with its own
   runtime, and makes it :func:`hpctrain.world`;
4. runs the :func:`hpctrain.world.on_reform` callbacks with it.

Cost: the shrink, plus making a communicator (three duplicates, the node's
split, a shared-memory window: tens of milliseconds on one node).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List

from .. import settings
from ..comm.backends.mpi.heartbeat import minority_side
from ..errors import HpctrainError, WorldFailedError

__all__ = ["reform", "Reformed", "WorldTooSmallError", "minority_side", "discard"]

MAX_ATTEMPTS = 8         # shrinks in one re-forming when ranks keep failing while the new world is built
FIRST_NEWS_S = 3.0      # how long a survivor waits for its library to name a failed process before it shrinks


class WorldTooSmallError(HpctrainError):
    """Fewer ranks survived than the elastic job's minimum (HPCTRAIN_ELASTIC_MIN_NP)."""


@dataclass
class Reformed:
    """What a re-forming did: sizes, who was lost, and how long its parts took (seconds)."""

    old_size: int
    new_size: int
    old_rank: int
    new_rank: int
    lost: List[int] = field(default_factory=list)        # old world ranks that failed
    lost_text: str = ""                                   # the same, with their nodes
    shrink_s: float = 0.0
    build_s: float = 0.0


def reform():
    """Re-form the world from the ranks that survive; return ``(new world, Reformed)``.

    Collective over the survivors.  Raises :class:`WorldTooSmallError` when
    fewer than ``HPCTRAIN_ELASTIC_MIN_NP`` ranks are left (the new world is not
    made), and HpctrainError outside elastic mode or on a backend without
    ULFM.  A rank that fails while the new world is built makes the survivors
    shrink again; one that fails in an ``on_reform`` callback makes it raise
    :class:`~hpctrain.errors.WorldFailedError` (its ``reformed`` attribute is
    this re-forming's :class:`Reformed`), as any collective of the new world
    would: :func:`hpctrain.elastic.run` re-forms again.
    """
    from ..comm.backends.mpi import ulfm, world_over
    from ..world.lifecycle import _replace_world, heartbeats_on, world

    old = world()
    policy = old.life.failure_policy
    if not policy.reforms or old.backend != "mpi":
        raise HpctrainError("hpctrain.elastic.reform() needs elastic mode on the MPI backend "
                            "(start the job with `hpctrain launch --elastic ...`)")
    from mpi4py import MPI

    detector = old.life.failure_detector
    silence_declared = heartbeats_on() or getattr(detector, "heartbeat", None) is not None
    lost = detector.settled(first_within=FIRST_NEWS_S) if detector is not None else []
    lost_text = detector.describe(lost) if detector is not None and lost else "no rank known"
    policy.world_failed(lost)           # (revokes the old communicators if this rank had not heard yet)
    t0 = time.monotonic()
    base, attempts = old.mpi_comm, 0
    while True:
        base = ulfm.shrink(base, MPI)
        gone = _gone(old.mpi_comm, base, MPI)
        if attempts == 0:
            t1 = time.monotonic()
            if detector is not None and not set(gone) <= set(lost):   # (a silent node's ranks, found one by one)
                lost = sorted(set(lost) | set(gone))
                lost_text = detector.describe(lost)
            info = Reformed(old.size, base.Get_size(), old.rank, base.Get_rank(), lost, lost_text, t1 - t0)
            discard(old)
        if silence_declared and not policy.planned_leave and minority_side(old.size, gone):
            from ..world import fail_this_rank

            share = "half of it, without rank 0" if 2 * base.Get_size() == old.size else "fewer than half of it"
            fail_this_rank(f"hpctrain: rank {old.rank}: the world of {old.size} ranks would re-form with "
                           f"{base.Get_size()}, {share}: the lesser side of a partition ends (heartbeats make each "
                           f"side see the other fail; the other side may be going on)")
        least = settings.get("HPCTRAIN_ELASTIC_MIN_NP")
        if base.Get_size() < least:
            raise WorldTooSmallError(f"hpctrain: {info.lost_text} failed and {base.Get_size()} of {old.size} ranks "
                                     f"are left, fewer than the job's minimum of {least} (--min-np); ending the job")
        try:
            new = world_over(base, old.config, "world", owns=True)
            break
        except Exception as exc:        # (a rank failed while the new world was being built: shrink again)
            if policy.world_error(exc) is None or attempts >= MAX_ATTEMPTS:
                raise
            attempts += 1
            ulfm.revoke([base], MPI)
            _DISCARDED.append(base)
            info.lost_text += " and a rank during the re-forming"
    info.new_size, info.new_rank = base.Get_size(), base.Get_rank()
    info.build_s = time.monotonic() - t1
    try:
        _replace_world(new)
    except WorldFailedError as exc:     # (an on_reform callback's collective met a new failure)
        exc.reformed = info
        raise
    return new, info


def _gone(old_comm, new_comm, MPI) -> List[int]:
    """The ranks of ``old_comm`` that are not in ``new_comm`` (its shrink): every rank the survivors left out."""
    kept = MPI.Group.Translate_ranks(new_comm.Get_group(), list(range(new_comm.Get_size())), old_comm.Get_group())
    return sorted(set(range(old_comm.Get_size())) - set(kept))


def discard(old) -> None:
    """Stop the old world on this rank (its runtime: lanes, watchdog) and keep its MPI objects unfreed.

    Freeing them is not safe: with Open MPI 5.0's ULFM, freeing a shared
    window of a node that lost a process made the next re-forming hang in
    ``MPI_Comm_dup`` (its context-id agreement), and the revoked
    communicators are no use.  They stay referenced here until the process
    ends; the cost is the old world's shared memory (its mailbox, and the
    arena and shared buckets where they were made) per re-forming.
    """
    old.life.discard()
    _DISCARDED.append(old)


_DISCARDED: list = []      # the old worlds of this process, kept so that nothing frees their MPI objects
