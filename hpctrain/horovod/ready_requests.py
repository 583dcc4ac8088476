"""What a negotiation cycle does with the requests every member has started (a mixin of the Controller).

Each cycle (:mod:`hpctrain.horovod.controller`) hands its table of named
requests here: a request every member of its process set has started (or
has joined past) is ready; one that some members never start is a stall
(:mod:`hpctrain.horovod.stalls`: warned, timed out, or failed as the oldest
of a deadlock).  Ready requests are grouped and fused by
:func:`hpctrain.horovod.execute.plan` and run on the set's communicator;
each rank's handle finishes with the result or the error.  Joined ranks
advance their counters of unnamed requests as if they had started them.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

from ..errors import HpctrainError
from . import execute
from .pending import Entry
from .stalls import noname_counter

__all__ = ["ReadyRequests"]


class ReadyRequests:
    """Running the ready requests of a cycle (uses the Controller's table, its own requests and join state)."""

    def _run_ready(self, now: float, waiting: List[bool]) -> None:
        ready: List[Tuple[str, Entry, Optional[HpctrainError]]] = []
        for name, entry in self._table.items():
            missing = [r for r in self._members(entry.ps) if r not in entry.sigs]
            absent = [r for r in missing if r not in self._joined]
            if absent:
                self._stalls.stalled(name, entry, absent, now, ready)
                continue
            error = execute.verdict(name, entry, missing, self.sets)
            ready.append((name, entry, error))
        stuck = self._stalls.deadlock(self._table, self._members, waiting, bool(ready), now)
        for name, _, _ in stuck:              # the ranks that never started it skip its unnamed number
            self._skip_counter(name)
        ready += stuck
        if not ready:
            return
        for name, _, _ in ready:
            del self._table[name]
        for group in execute.plan(ready, self._mine, self.sets):
            self._run_group(group)

    def _run_group(self, group: "execute.Group") -> None:
        mine = [self._mine.pop(name, None) for name in group.names]
        if group.error is not None:
            for req in mine:
                if req is not None:
                    req.handle._finish(error=group.error)
            self._count_joined(group.names)
            return
        if self.rank not in group.members:
            return
        if any(req is None and self.rank not in self._joined for req in mine):
            raise RuntimeError(f"internal error: {group.kind} {group.names} is ready but rank {self.rank} "
                               f"has no request for it")
        started = time.time()
        try:
            results = group.run(mine, self)
            error = None
        except (ValueError, TypeError, ArithmeticError) as exc:   # a bad argument the signature did not show
            results, error = [None] * len(mine), exc
        except BaseException:       # (the world failed under it: the loop's end fails what is open, these too)
            with self._cv:
                self._mine.update((req.name, req) for req in mine if req is not None)
            raise
        if self.timeline is not None:
            self.timeline.ran(group, mine, started, time.time(), self.world.backend)
        for req, value in zip(mine, results):
            if req is not None:
                req.handle._finish(value, error)
        self._count_joined(group.names)

    def _count_joined(self, names: List[str]) -> None:
        """A joined rank took part in unnamed requests: advance its counters as if it had started them."""
        if self.rank not in self._joined:
            return
        for name in names:
            self._skip_counter(name)

    def _skip_counter(self, name: str) -> None:
        """Advance this rank's counter of unnamed requests past ``name``'s number (if it is an unnamed one)."""
        counter = noname_counter(name)
        if counter is not None:
            key, n = counter
            with self._cv:
                self._noname[key] = max(self._noname.get(key, 0), n + 1)

    def _finish_join(self) -> None:
        if len(self._joined) < self.size:
            return
        last = max(self._joined.values())
        last_rank = max(r for r, c in self._joined.items() if c == last)
        self._joined.clear()
        with self._cv:
            handle, self._join_handle = self._join_handle, None
        if handle is not None:
            handle._finish(last_rank)
