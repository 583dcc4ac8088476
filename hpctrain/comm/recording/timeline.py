"""A timeline of what every rank did: a Chrome trace-event JSON file that Perfetto and chrome://tracing load.

Each rank records spans (complete events, ``"ph": "X"``) while its timeline
is on: every collective of the communicator (its kind, bytes, dtype, shape,
op and algorithm) split into its phases

* ``queued``: from the call until the collective lane starts it (earlier
  asynchronous calls run first);
* ``waiting for peers``: the call check, which ends when every rank has
  arrived (with small calls the data is carried along);
* ``transfer and reduce``: the algorithm's own work, which hpctrain's own
  algorithms split further with :meth:`Timeline.phase`: the ring its
  reduce-scatter and all-gather; the shared-memory all-reduce its copy in,
  its waits at the fences (for the peers), its reduction (which reads the
  peers' memory, so there transfer and reduction are one pass), the ring
  across nodes of the hierarchical form, and its copy out; the direct form
  its address exchange, its copies and its final barrier (a library call
  stays opaque);

each fusion buffer of a grouped all-reduce, gradient compression and
decompression, and, through the adapters, forward (torch, with
:func:`hpctrain.torch.trace_forward`), backward and optimizer step (torch's
DistributedOptimizer), train steps and their forward, backward, gradient
synchronisation and update (Keras, ``TimelineCallback``) and checkpoint
saves.  Rows: one process per rank (``rank <r>``), one thread row per
Python thread (the caller's, the collective lane).

:func:`write_trace` (a collective: every rank calls it; ``hpctrain.shutdown()``
does it when ``HPCTRAIN_TIMELINE=path`` is set) sends every rank's events to
rank 0, which writes one file.  Clocks: each rank's ``perf_counter`` is
aligned on rank 0's at the exits of barriers just before the merge, so the
ranks' rows agree to within the barriers' exit spread (microseconds on a
node, a network latency across nodes) whatever the nodes' wall clocks say;
each rank's wall clock offset from rank 0 is kept in ``otherData``.  Switch it at run time
with ``comm.timeline.start()`` / ``.stop()``.

It lives with the communicator (as the communication log does) because every
collective records into it; :mod:`hpctrain.observe` re-exports it.
Cost while on: two clock reads and a tuple per span (a collective makes
four), kept in memory (a few hundred bytes each) until the file is written;
while off: one attribute test per collective.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from .recorder import Recorder

__all__ = ["Timeline", "span_of", "write_trace"]

_TAG = 0x71E1          # point-to-point tag of the events sent to rank 0
_CLOCK_ROUNDS = 5      # barrier exits sampled to align the ranks' clocks (their median difference is used)
_OFF = contextlib.nullcontext()


class _Span:
    __slots__ = ("tl", "name", "cat", "args", "start")

    def __init__(self, tl, name, cat, args):
        self.tl, self.name, self.cat, self.args = tl, name, cat, args

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.tl.add(self.name, self.cat, self.start, time.perf_counter(), self.args)
        return False


class Timeline(Recorder):
    """One rank's recorder (shared by the communicators of its world): spans in ``perf_counter`` seconds.

    Recording appends one tuple (``list.append`` is atomic, so no lock is
    taken on the way); names, rows and phases are worked out when the trace
    is written.
    """

    def __init__(self, on: bool = False):
        super().__init__(on)
        self._events: List[Tuple] = []
        self._names: Dict[int, str] = {}       # thread ident -> name, as first seen

    def _forget(self) -> None:
        self._events = []

    def adopt(self, older: "Timeline") -> None:
        """Put ``older``'s events (this rank's, recorded in a world that re-formed into this one) before this one's."""
        with self._lock:
            self._events = list(older._events) + self._events
            self._names = {**older._names, **self._names}

    def span(self, name: str, cat: str, **args):
        """A context manager that records ``name`` around its block (nothing while off)."""
        return _Span(self, name, cat, args) if self.on else _OFF

    def phase(self, name: str, **args):
        """A context manager that records an algorithm's phase ``name`` inside its collective (nothing while off)."""
        return _Span(self, name, "collective phase", args) if self.on else _OFF

    def add(self, name: str, cat: str, start: float, end: float, args: Optional[dict] = None) -> None:
        """Record a span of the calling thread from ``start`` to ``end`` (``time.perf_counter()`` values)."""
        ident = threading.get_ident()
        if ident not in self._names:
            self._names[ident] = threading.current_thread().name
        self._events.append((name, cat, start, end, ident, args))

    def collective(self, call, comm_name: str, nbytes: int, issued: float, start: float, checked: float,
                   end: float) -> None:
        """Record one collective and its phases (see the module docstring); they are expanded when written."""
        ident = threading.get_ident()
        if ident not in self._names:
            self._names[ident] = threading.current_thread().name
        self._events.append((call, comm_name, start, end, ident, (nbytes, issued, checked)))

    def trace_events(self, rank: int, zero: float, ts0_us: float) -> List[dict]:
        """This rank's events in trace-event form: ``ts = ts0_us + (t - zero)`` microseconds."""
        with self._lock:
            events, names = list(self._events), dict(self._names)
        tids = {ident: i for i, ident in enumerate(names)}
        out = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
               {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}}]
        out += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tids[ident], "args": {"name": name}}
                for ident, name in names.items()]

        def span(name, cat, start, end, tid, args):
            ev = {"name": name, "cat": cat, "ph": "X", "pid": rank, "tid": tid,
                  "ts": round(ts0_us + (start - zero) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3)}
            if args:
                ev["args"] = args
            out.append(ev)

        for first, second, start, end, ident, args in events:
            tid = tids[ident]
            if isinstance(first, str):
                span(first, second, start, end, tid, args)
                continue
            call, (nbytes, issued, checked) = first, args
            if start - issued > 20e-6:
                span("queued", "collective phase", issued, start, tid, {"seq": call.seq})
            span(call.kind, "collective", start, end, tid,
                 {"communicator": second, "seq": call.seq, "bytes": nbytes, "dtype": call.dtype,
                  "shape": list(call.shape), "op": call.op, "algorithm": call.algorithm})
            span("waiting for peers", "collective phase", start, checked, tid, {"seq": call.seq})
            span("transfer and reduce", "collective phase", checked, end, tid, {"seq": call.seq})
        return out


def span_of(comm, name: str, cat: str, **args):
    """``comm.timeline.span(...)``, or a context that records nothing when ``comm`` has no timeline (hpctrain.horovod's
    negotiated communicator) or it is off."""
    tl = getattr(comm, "timeline", None)
    return tl.span(name, cat, **args) if tl is not None else _OFF


def write_trace_at_close(world, path: str, on_reform) -> None:
    """Write the job's trace to ``path`` when the world closes (hpctrain.shutdown()), and in elastic mode when the
    re-formed world closes: each new world's recorder first takes this rank's events from the old one
    (``on_reform``: :func:`hpctrain.world.on_reform`, given by the caller above this module)."""
    held = [world]
    world.on_close(lambda: write_trace(world, path), f"the timeline writer ({path})")

    def follow(new) -> None:
        new.timeline.adopt(held[0].timeline)
        held[0] = new
        new.on_close(lambda: write_trace(new, path), f"the timeline writer ({path})")
    on_reform(follow)


def write_trace(comm, path: str) -> Optional[str]:
    """Merge every rank's timeline into one Chrome trace file at ``path``, written by rank 0 (a collective).

    Returns ``path`` on rank 0, None elsewhere.  Events stay recorded (call
    ``comm.timeline.clear()`` to start afresh).  Clocks: each rank reads its
    ``perf_counter`` at the exit of 5 barriers; its shift from rank 0 is the
    median difference (a rank descheduled at one exit does not skew it).
    Cost: 5 barriers and all-gathers of 16 bytes, and one message of each
    rank's events to rank 0.
    """
    tl = comm.timeline
    recording, tl.on = tl.on, False          # (its own collectives stay off the timeline)
    try:
        samples = []
        for _ in range(_CLOCK_ROUNDS):
            comm.barrier()
            pc = time.perf_counter()
            samples.append(np.asarray(comm.allgather(np.array([pc, time.time()], dtype=np.float64))).reshape(-1, 2))
    finally:
        tl.on = recording
    pcs = np.stack([s[:, 0] for s in samples])       # rounds x ranks: each rank's clock at each barrier's exit
    shift = float(np.median(pcs[:, comm.rank] - pcs[:, 0]))   # this rank's clock minus rank 0's
    pc0, wall0 = samples[-1][0]
    ts0_us = float(wall0) * 1e6              # rank 0's wall clock at its last sample
    mine = tl.trace_events(comm.rank, float(pc0) + shift, ts0_us)
    if comm.rank != 0:
        blob = json.dumps(mine).encode()
        comm.send_async(np.frombuffer(blob, dtype=np.uint8), 0, _TAG, header=False).wait()
        return None
    events = mine
    for r in range(1, comm.size):
        events += json.loads(comm.recv_bytes(r, tag=_TAG).tobytes())
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"producer": "hpctrain", "ranks": comm.size,
                           "clock": "each rank's perf_counter aligned at a barrier's exit before the merge",
                           "wall_clock_offset_s": [float(w - samples[-1][0, 1]) for w in samples[-1][:, 1]]}}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(trace, f)
    os.replace(tmp, path)
    return path
