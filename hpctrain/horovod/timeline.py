"""Horovod's timeline: a Chrome-trace JSON file of the negotiated collectives, written by rank 0.

Open it in ``chrome://tracing`` or Perfetto.  Each request name is one row:
``NEGOTIATE_<KIND>`` spans from the cycle in which some rank started it to the
cycle in which every rank had, then ``<KIND>`` spans its execution; with
``mark_cycles=True`` every negotiation cycle is an instant event
``CYCLE_START``.  Times are microseconds since the timeline started; the
first record carries ``start_time_since_epoch_in_micros``.  The file is
written when the timeline stops (``hvd.stop_timeline()``, ``hvd.shutdown()``).
Cost: one small dict per event in rank 0's memory while it records.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List

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

    def _add(self, name: str, ph: str, label: str) -> None:
        if self.path is None:
            return
        with self._lock:
            self._events.append({"name": label, "ph": ph, "ts": int((time.time() - self._t0) * 1e6),
                                 "pid": self._row(name), "tid": 0})

    def negotiate(self, name: str, kind: str) -> None:
        """A rank started ``name``: negotiation begins."""
        self._add(name, "B", f"NEGOTIATE_{kind.upper()}")

    def start(self, name: str, kind: str) -> None:
        """Every rank started ``name``: negotiation ends, execution begins."""
        self._add(name, "E", f"NEGOTIATE_{kind.upper()}")
        self._add(name, "B", kind.upper())

    def end(self, name: str, kind: str) -> None:
        """``name`` finished on this rank."""
        self._add(name, "E", kind.upper())

    def cycle(self) -> None:
        """A negotiation cycle began (recorded only with ``mark_cycles``)."""
        if self.mark_cycles and self.path is not None:
            with self._lock:
                self._events.append({"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                                     "ts": int((time.time() - self._t0) * 1e6)})

    def close(self) -> None:
        """Write the file (atomically: a temporary name, then a rename)."""
        if self.path is None:
            return
        with self._lock:
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(self._events, f)
            os.replace(tmp, self.path)
