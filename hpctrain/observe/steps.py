"""Per-step metrics of a training loop on every rank: time, throughput, communication, stragglers, resources.

Call :meth:`StepMetrics.mark` at the end of every step (the torch and Keras
helpers do it for you: :func:`hpctrain.torch.track_steps`,
:class:`hpctrain.tensorflow.keras.StepMetricsCallback`).  Per rank and step:

* ``step_s``: wall time since the previous mark;
* ``exposed_comm_s``: time this thread was blocked on collectives (a
  synchronous call, or ``wait()`` on one still running), the communication
  that did not overlap with computation; ``exposed_comm_fraction`` is its
  share of the step;
* ``comm_s``: time the collectives themselves took (overlapped or not);
* ``busy_s = step_s - exposed_comm_s``: what the rank spent on its own work;
* ``bytes``: input bytes of its collectives; ``compression_ratio``: float32
  bytes over bytes sent by the gradient compressor (1 without one).

In synchronous training every rank's ``step_s`` is the same (the others
wait for the slowest in the gradient all-reduce), so stragglers show in
``busy_s``: every ``interval`` steps the ranks all-gather their window of
steps and resource samples, and a rank whose ``busy_s`` is at least
``straggler_factor`` times the median over ranks (and ``straggler_min_s``
more) for ``straggler_steps`` steps in a row is named in a warning (logger
``hpctrain.observe``, rank 0).
Rank 0 writes one row per step over all ranks (median and maximum step and
busy time, the slowest rank and the spread ``max/median`` of busy time,
mean exposed fraction, samples per second of the whole job) and per-rank
rows of each window to ``log_dir`` (:mod:`hpctrain.observe.sinks`).

Cost: two clock reads and a dictionary update per collective (the
communication log is switched on), one all-gather of
``6 * interval + 8`` float64 values per rank every ``interval`` steps, and a
few system calls for a resource sample at most once a second.  Every rank must mark the same
number of steps: the all-gather is a collective, and ranks that gather
different windows get an error on every rank that names their steps.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from typing import Callable, Deque, Dict, List, Optional

import numpy as np

from ..hooks import Hooks
from .resources import FIELDS, ResourceSampler

__all__ = ["StepMetrics"]

KEEP_ROWS = 10_000     # rank 0 keeps this many step rows in memory (the files have them all)
_LOCAL = ("step_s", "busy_s", "exposed_comm_s", "comm_s", "bytes", "samples")
log = logging.getLogger("hpctrain.observe")


class StepMetrics:
    """Measure every step of a training loop on every rank (see the module docstring).

    Args:
        comm: the communicator of the data-parallel ranks (default: the world).
        log_dir: run folder rank 0 writes to (None: keep the values in memory only).
        samples_per_step: samples one rank processes per step (for samples/s); ``mark(samples=)`` overrides it.
        interval: steps per all-gather of the ranks' windows (and per resource sample).
        straggler_factor, straggler_steps, straggler_min_s: the straggler rule (a slow step is also at least
            ``straggler_min_s`` over the median: scheduler noise in millisecond steps is not a straggler).
        tensorboard: also write TensorBoard event files under ``log_dir/tensorboard``.
        resources: sample CPU, memory, network and GPU use per rank (gathered every window).
        compression: a callable returning the gradient compressor's totals (``sent_bytes``, ``dense_bytes``),
            e.g. a DistributedOptimizer's ``compression_stats``.
        step: steps done before (a resumed run): the first ``mark()`` is step ``step + 1``.
        resource_interval_s: at most one resource sample this often (a window in between repeats the last).
    """

    def __init__(self, comm=None, log_dir: Optional[str] = None, samples_per_step: Optional[int] = None,
                 interval: int = 10, straggler_factor: float = 1.5, straggler_steps: int = 3,
                 tensorboard: bool = True, resources: bool = True,
                 compression: Optional[Callable[[], Dict]] = None, step: int = 0,
                 resource_interval_s: float = 1.0, straggler_min_s: float = 0.005):
        from ..world import comm_or_world

        if interval < 1 or straggler_steps < 1 or straggler_factor <= 1:
            raise ValueError(f"need interval >= 1, straggler_steps >= 1 and straggler_factor > 1, got "
                             f"{interval}, {straggler_steps}, {straggler_factor}")
        self.comm = comm_or_world(comm)
        self.samples_per_step = samples_per_step
        self.interval, self.factor, self.patience = interval, straggler_factor, straggler_steps
        self.straggler_min_s = straggler_min_s
        self._compression = compression
        self._log = self.comm.comm_log
        self._log_was_on = self._log.on
        self._log.start()
        self._sampler = ResourceSampler() if resources else None
        self.resource_interval_s = resource_interval_s
        self._sample: Optional[Dict[str, float]] = None
        self._sampled_at = 0.0
        self._writer = None
        if log_dir is not None:
            from ..agreement import check_writable

            why = check_writable(self.comm, os.path.join(log_dir, "steps.jsonl"))
            if why:
                raise ValueError(f"StepMetrics cannot write its run folder {log_dir}: {why}")
            if self.comm.rank == 0:
                from .sinks import RunWriter
                self._writer = RunWriter(log_dir, tensorboard=tensorboard)
        self.step = int(step)
        self.latest: Optional[Dict] = None       # this rank's last step
        self.rows: Deque[Dict] = collections.deque(maxlen=KEEP_ROWS)   # rank 0: the last steps over all ranks
        self._run_sums = np.zeros(4)             # rank 0, whole run: steps, slowest step times, samples, exposed shares
        self.stragglers: List[Dict] = []         # every rank: the straggler warnings so far
        self._window: List[Dict] = []
        self._recent: Deque[Dict] = collections.deque(maxlen=interval)
        self._streak = np.zeros(self.comm.size, dtype=np.int64)
        self._closed = False
        self.close_hooks = Hooks("close")   # run by close() (e.g. removing a framework hook)
        self._last = time.perf_counter()
        self._totals = self._log.totals()
        self._compressed = self._compression_totals()
        self._log_dir, self._tensorboard = log_dir, tensorboard
        self._forget_close = self._close_with(self.comm)
        if comm is None:            # (elastic mode: go on over each re-formed world)
            from ..world import on_reform

            on_reform(StepMetrics._follow, owner=self)

    def _close_with(self, comm) -> Callable[[], None]:
        """Be closed (flushed) when ``comm`` closes at hpctrain.shutdown() unless closed before."""
        return comm.on_close(self.close, f"the step metrics ({self._log_dir or 'in memory'})")

    def _follow(self, world) -> None:
        """Go on over ``world``, the re-formed world of elastic mode (collective over it: every survivor).

        The window in flight is dropped (its steps were marked by ranks of the
        old world, not all of them alike); the survivors go on from the lowest
        step any of them marked; a new rank 0 (the old one died) opens the run
        folder to append to it.
        """
        if self._closed:
            return
        self._forget_close()
        self.comm = world
        self._log = world.comm_log
        self._log.start()
        self._totals = self._log.totals()
        self._window, self._streak = [], np.zeros(world.size, dtype=np.int64)
        self._recent.clear()
        self.step = int(np.asarray(world.allreduce(np.array([self.step], dtype=np.int64), op="min"))[0])
        if self._log_dir is not None and world.rank == 0 and self._writer is None:
            from .sinks import RunWriter
            self._writer = RunWriter(self._log_dir, tensorboard=self._tensorboard)
        self._last = time.perf_counter()
        self._forget_close = self._close_with(world)

    def _compression_totals(self):
        if self._compression is None:
            return (0.0, 0.0)
        s = self._compression()
        sent = float(s.get("sent_bytes", 0))
        return float(s.get("dense_bytes", sent)), sent

    def mark(self, samples: Optional[int] = None) -> Dict:
        """End a step: measure it, and every ``interval`` steps gather the ranks' windows (a collective)."""
        if self._closed:
            raise RuntimeError("StepMetrics.mark() after close()")
        now = time.perf_counter()
        step_s, self._last = now - self._last, now
        totals = self._log.totals()
        calls, nbytes, comm_s, blocked = (a - b for a, b in zip(totals, self._totals))
        self._totals = totals
        dense, sent = self._compression_totals()
        ratio = (dense - self._compressed[0]) / (sent - self._compressed[1]) if sent > self._compressed[1] else 1.0
        self._compressed = (dense, sent)
        exposed = min(max(blocked, 0.0), step_s)
        samples = self.samples_per_step if samples is None else samples
        self.step += 1
        rec = {"step": self.step, "step_s": step_s, "busy_s": step_s - exposed, "exposed_comm_s": exposed,
               "exposed_comm_fraction": exposed / step_s if step_s > 0 else 0.0, "comm_s": comm_s,
               "bytes": nbytes, "compression_ratio": ratio, "samples": samples or 0,
               "samples_per_s": (samples or 0) / step_s if step_s > 0 else 0.0}
        self.latest = rec
        self._window.append(rec)
        self._recent.append(rec)
        if len(self._window) >= self.interval:
            self._gather()
            self._totals, self._last = self._log.totals(), time.perf_counter()   # the next step leaves it out
        return rec

    def postfix(self) -> Dict[str, str]:
        """What rank 0's progress bar shows, over this rank's last ``interval`` steps: samples/s of the
        whole job (this rank's samples x ranks / step time) and the exposed communication share."""
        recent = self._recent
        if not recent:
            return {}
        step_s = sum(r["step_s"] for r in recent)
        exposed = sum(r["exposed_comm_s"] for r in recent)
        out = {"comm": f"{exposed / step_s:.1%}" if step_s > 0 else "-"}
        samples = sum(r["samples"] for r in recent)
        if samples and step_s > 0:
            out = {"samples/s": f"{samples * self.comm.size / step_s:.0f}", **out}
        return out

    def _gather(self) -> None:
        """All-gather the window (steps and a resource sample) and write / warn on rank 0.

        Every rank sends ``[steps in its window, interval x _LOCAL (NaN-padded), FIELDS]`` (the same
        length on every rank); ranks whose windows differ raise the same error on every rank.
        """
        window, self._window = self._window, []
        k, width = len(window), len(_LOCAL)
        local = np.full((self.interval, width), np.nan)
        local[:k] = [[r[f] for f in _LOCAL] for r in window]
        sample = self._resources()
        res = np.array([sample.get(f, np.nan) for f in FIELDS], dtype=np.float64)
        every = np.asarray(self.comm.allgather(np.concatenate([[k, window[0]["step"]], local.ravel(), res])))
        every = every.reshape(self.comm.size, -1)
        if (every[:, :2] != every[0, :2]).any():
            told = ", ".join(f"rank {r}: steps {int(a)}-{int(a + n - 1)}" for r, (n, a) in enumerate(every[:, :2]))
            raise RuntimeError(f"hpctrain.observe: the ranks marked different steps ({told}); every rank must call "
                               f"StepMetrics.mark() once per step and close() at the same step")
        steps = every[:, 2:2 + self.interval * width].reshape(self.comm.size, self.interval, width)[:, :k]
        res_all = every[:, 2 + self.interval * width:]
        first = window[0]["step"]
        busy = steps[:, :, _LOCAL.index("busy_s")]                 # ranks x steps
        median = np.median(busy, axis=0)
        self._check_stragglers(first, busy, median)
        if self.comm.rank != 0:
            return
        rows = self._step_rows(window, steps, busy, median)
        self.rows.extend(rows)
        self._run_sums += [len(rows), sum(r["step_s_max"] for r in rows), sum(r["samples"] for r in rows),
                           sum(r["exposed_comm_fraction"] for r in rows)]
        if self._writer is not None:
            for row in rows:
                self._writer.step(row)
            self._writer.ranks(self._rank_rows(first, first + k - 1, steps, res_all))
            self._writer.flush()

    def _resources(self) -> Dict[str, float]:
        """This rank's resource sample when ``resource_interval_s`` has passed since the last, else nothing
        (the window's row then has no resource values: the plots show the samples that were taken)."""
        if self._sampler is None:
            return {}
        now = time.monotonic()
        if self._sample is None or now - self._sampled_at >= self.resource_interval_s:
            self._sample, self._sampled_at = self._sampler.sample(), now
            return self._sample
        return {}

    def _step_rows(self, window: List[Dict], steps: np.ndarray, busy: np.ndarray, median: np.ndarray) -> List[Dict]:
        """One row per step over all ranks (``steps``: ranks x steps x _LOCAL), computed for the window at once."""
        col = {f: steps[:, :, i] for i, f in enumerate(_LOCAL)}
        step_max = col["step_s"].max(axis=0)
        busy_max = busy.max(axis=0)
        samples = col["samples"].sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            spread = np.where(median > 0, busy_max / median, 1.0)
            throughput = np.where(step_max > 0, samples / step_max, 0.0)
        values = zip(np.median(col["step_s"], axis=0).tolist(), step_max.tolist(), median.tolist(), busy_max.tolist(),
                     np.argmax(busy, axis=0).tolist(), spread.tolist(),
                     np.mean(col["exposed_comm_s"] / np.maximum(col["step_s"], 1e-12), axis=0).tolist(),
                     col["comm_s"].mean(axis=0).tolist(), col["bytes"].mean(axis=0).tolist(), samples.tolist(),
                     throughput.tolist())
        now = time.time()
        return [{"step": mine["step"], "time": now, "step_s": a, "step_s_max": b, "busy_s_median": c,
                 "busy_s_max": d, "slowest_rank": e, "busy_spread": f, "exposed_comm_fraction": g, "comm_s": h,
                 "bytes_per_rank": i, "compression_ratio": mine["compression_ratio"], "samples": int(j),
                 "samples_per_s": t}
                for mine, (a, b, c, d, e, f, g, h, i, j, t) in zip(window, values)]

    def _rank_rows(self, first: int, last: int, steps: np.ndarray, res: np.ndarray) -> List[Dict]:
        """Per rank over the window: mean step and busy time, exposed fraction, and its resource sample."""
        rows = []
        for r in range(self.comm.size):
            s = steps[r]
            row = {"rank": r, "step_first": first, "step_last": last,
                   "step_s_mean": float(s[:, 0].mean()), "busy_s_mean": float(s[:, 1].mean()),
                   "exposed_comm_fraction": float(s[:, 2].sum() / max(s[:, 0].sum(), 1e-12))}
            row.update({f: float(v) for f, v in zip(FIELDS, res[r])})
            rows.append(row)
        return rows

    def _check_stragglers(self, first: int, busy: np.ndarray, median: np.ndarray) -> None:
        """Count steps in a row at >= factor x the median busy time; warn when a rank's count reaches the limit."""
        if busy.shape[0] < 2:
            return
        slow = (busy >= self.factor * median) & (busy - median >= self.straggler_min_s) & (median > 0)
        if not slow.any() and not self._streak.any():
            return
        for j in range(busy.shape[1]):
            self._streak = np.where(slow[:, j], self._streak + 1, 0)
            for r in np.flatnonzero(self._streak == self.patience):
                self._straggler(int(r), first + j, float(busy[r, j]), float(median[j]), busy.shape[0])

    def _straggler(self, r: int, step: int, busy: float, median: float, ranks: int) -> None:
        event = {"rank": r, "step_first": step - self.patience + 1, "step_last": step,
                 "busy_s": busy, "median_busy_s": median, "ratio": busy / median}
        self.stragglers.append(event)
        if self.comm.rank == 0:
            log.warning("hpctrain: rank %d is a straggler: its own work took %.1fx the median of the %d ranks "
                        "for %d steps in a row (steps %d-%d; at step %d %.3f s against %.3f s), and the other "
                        "ranks wait for it", r, event["ratio"], ranks, self.patience, event["step_first"],
                        step, step, busy, median)
            if self._writer is not None:
                self._writer.straggler(event)

    def close(self) -> None:
        """Gather the last, partial window (a collective: every rank calls it), close the files."""
        if self._closed:
            return
        if self._window:
            self._gather()
        self._closed = True
        self.close_hooks.run()
        if self._writer is not None:
            self._writer.close()
        if not self._log_was_on:
            self._log.stop()
        self._forget_close()

    def summary(self) -> Dict:
        """Rank 0: steps, mean step time, samples/s and exposed communication share over the run; medians of
        step time and spread over the last ``KEEP_ROWS`` steps; the stragglers."""
        n, step_sum, samples, exposed = self._run_sums
        if not n:
            return {"steps": self.step, "stragglers": list(self.stragglers)}
        return {"steps": self.step, "step_s_mean": float(step_sum / n),
                "step_s_median": float(np.median([r["step_s_max"] for r in self.rows])),
                "samples_per_s": float(samples / step_sum) if step_sum > 0 else 0.0,
                "exposed_comm_fraction": float(exposed / n),
                "busy_spread_median": float(np.median([r["busy_spread"] for r in self.rows])),
                "stragglers": list(self.stragglers)}
