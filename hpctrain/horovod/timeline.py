"""Horovod's timeline: a Chrome-trace JSON file of the negotiated collectives, written by rank 0.

Open it in ``chrome://tracing`` or Perfetto.  As Horovod's own timeline, one
row per tensor name: a DistributedOptimizer's reductions are rows
``allreduce.<parameter name>`` (one per tensor of a gradient bucket, though
the bucket travels as one reduction); other requests are rows of their own
name.  On each row, ``NEGOTIATE_<KIND>`` spans from the cycle in which the
first rank started the request to the one in which the last did, with an
instant event named after each rank at the cycle its request arrived in;
then ``<KIND>`` spans the execution, with one nested activity named after
what ran it (``MPI_ALLREDUCE`` on the MPI backend, ``HOROVOD_ALLREDUCE``
where Horovod carries the job and reduces a gradient bucket by name; there
no negotiation of hpctrain's is shown).  With ``mark_cycles=True`` every
negotiation cycle is an instant event ``CYCLE_START``.  Times are
microseconds since the timeline started; the first record carries
``start_time_since_epoch_in_micros``.  The file is written when the timeline
stops (``hvd.stop_timeline()``, ``hvd.shutdown()``).  Cost: a few small
dicts per tensor and request in rank 0's memory while it records.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List, Sequence, Tuple

__all__ = ["Timeline"]


class Timeline:
    """Records events while active (rank 0 only; other ranks pass ``path=None`` and record nothing)."""

    def __init__(self, path, mark_cycles: bool = False):
        self.path, self.mark_cycles = path, mark_cycles
        self._lock = threading.Lock()
        self._t0 = time.time()
        self._rows: Dict[str, int] = {}
        self._events: List[dict] = [{"name": "hpctrain_timeline", "ph": "M", "pid": 0,
                                     "args": {"start_time_since_epoch_in_micros": int(self._t0 * 1e6)}}]

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._events.append({"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}})
        return row

    def _us(self, t: float) -> int:
        return int((t - self._t0) * 1e6)

    def _span(self, row: int, label: str, begin: float, end: float) -> None:
        self._events.append({"name": label, "ph": "B", "ts": self._us(begin), "pid": row, "tid": 0})
        self._events.append({"name": label, "ph": "E", "ts": self._us(end), "pid": row, "tid": 0})

    def ran(self, group, mine, start: float, end: float, backend: str) -> None:
        """A group of ready requests ran from ``start`` to ``end`` (wall clock): their rows' events.

        ``group``: :class:`hpctrain.horovod.execute.Group` (names, and entries with when each rank's
        request arrived); ``mine``: this rank's requests, whose labels name the rows.
        """
        if self.path is None:
            return
        with self._lock:
            for name, entry, req in zip(group.names, group.entries, mine):
                labels: Sequence[Tuple[str, str]] = req.labels if req is not None else ((name, group.kind),)
                for label, kind in labels:
                    row, kind = self._row(label), kind.upper()
                    self._events.append({"name": f"NEGOTIATE_{kind}", "ph": "B", "ts": self._us(entry.since),
                                         "pid": row, "tid": 0})
                    for rank, t in sorted(entry.arrived.items()):
                        self._events.append({"name": str(rank), "ph": "X", "ts": self._us(t), "dur": 0, "pid": row,
                                             "tid": 0})
                    self._events.append({"name": f"NEGOTIATE_{kind}", "ph": "E", "ts": self._us(start), "pid": row,
                                         "tid": 0})
                    self._events.append({"name": kind, "ph": "B", "ts": self._us(start), "pid": row, "tid": 0})
                    self._span(row, f"{backend.upper()}_{kind}", start, end)
                    self._events.append({"name": kind, "ph": "E", "ts": self._us(end), "pid": row, "tid": 0})

    def direct(self, rows: Sequence[str], start: float, end: float) -> None:
        """A gradient bucket that Horovod reduced by name from ``start`` to ``end``: an ALLREDUCE per row."""
        if self.path is None:
            return
        with self._lock:
            for label in rows:
                row = self._row(label)
                self._events.append({"name": "ALLREDUCE", "ph": "B", "ts": self._us(start), "pid": row, "tid": 0})
                self._span(row, "HOROVOD_ALLREDUCE", start, end)
                self._events.append({"name": "ALLREDUCE", "ph": "E", "ts": self._us(end), "pid": row, "tid": 0})

    def cycle(self) -> None:
        """A negotiation cycle began (recorded only with ``mark_cycles``)."""
        if self.mark_cycles and self.path is not None:
            with self._lock:
                self._events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                                     "ts": self._us(time.time())})

    def close(self) -> None:
        """Write the file (atomically: a temporary name, then a rename)."""
        if self.path is None:
            return
        with self._lock:
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self._events, f)
            os.replace(tmp, self.path)
