"""Requests that cannot complete: stalls (some ranks never start one) and deadlocks (every rank waits).

:class:`~hpctrain.horovod.controller.Controller` asks :class:`StallWatch`
each cycle, with the same table and messages on every rank, so every rank
reaches the same verdict in the same cycle:

* a request started by some members and not by others is logged after
  ``HPCTRAIN_STALL_WARNING_S`` and fails after ``HPCTRAIN_STALL_TIMEOUT_S``
  (rank 0's clock);
* a deadlock: every rank's program waits on a request (each message says
  so), nothing ran, and it stays that way for ``DEADLOCK_S``.  No rank can
  start anything more, so no request that some members lack can complete;
  the oldest of them (by the cycle it arrived in, then by when its first
  rank started it) fails at once on the ranks that started it, naming
  who waits on what.  Its ranks go on (their next requests may be what the
  others wait for), and the ranks that never started it, if it is an
  unnamed request, advance their counter past it, so that the next unnamed
  requests of that kind match again.  The oldest, because ranks that left
  a loop of collectives early (a test that failed half-way through, on some
  ranks only) reach their next request only after unwinding and reporting
  the error, while the others asked for the loop's next iteration at once:
  those fail, and everyone meets again at the leavers' request.  That is a
  judgement on timing, not a proof: where the ranks that left are quicker,
  they are the ones that fail, and they fail again at each request until
  the others catch up; either way every wait ends with an error naming the
  ranks, never a hang.

Cost: nothing beyond one flag in each rank's cycle message.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

from ..errors import format_ranks
from ..errors import CollectiveMismatchError

__all__ = ["StallWatch", "DEADLOCK_S", "noname_counter", "started_all_open"]

log = logging.getLogger("hpctrain")

# Every rank waiting and nothing running for this long is a deadlock.  Not less: a thread of a rank may wait
# while another thread of it still computes the request the others wait for (TensorFlow runs graph ops so).
DEADLOCK_S = 5.0


class StallWatch:
    """The stall and deadlock verdicts of one rank's negotiation (see the module docstring)."""

    def __init__(self, rank: int, warn_s: float, timeout_s: float):
        self.rank, self._warn_s, self._timeout_s = rank, warn_s, timeout_s
        self._all_waiting_since: Optional[float] = None

    def stalled(self, name: str, entry, absent: List[int], now: float, ready: list) -> None:
        """Warn about, or (past the timeout) fail, request ``name`` that ``absent`` ranks have not started."""
        waited = now - entry.since
        text = (f"{entry.kind} {name!r} was started by {format_ranks(sorted(entry.sigs))} "
                f"but not by {format_ranks(absent)} for {waited:.0f} s")
        if self._timeout_s and waited > self._timeout_s:
            ready.append((name, entry, CollectiveMismatchError(text + " (HPCTRAIN_STALL_TIMEOUT_S)")))
        elif self._warn_s and waited > self._warn_s and not entry.warned:
            entry.warned = True
            if self.rank == 0:
                log.warning("hpctrain.horovod: %s; those ranks may have stopped early or call "
                            "collectives in a different way", text)

    def deadlock(self, table: Dict, members, waiting: List[bool], ran: bool, now: float) -> list:
        """The ``(name, entry, error)`` to fail now because every rank waits and nothing can run (or [])."""
        if ran or not table or not all(waiting):
            self._all_waiting_since = None
            return []
        if self._all_waiting_since is None:
            self._all_waiting_since = now
            return []
        if now - self._all_waiting_since < DEADLOCK_S:
            return []
        self._all_waiting_since = None
        lacking = [(entry.since, entry.first, name, entry) for name, entry in table.items()
                   if any(r not in entry.sigs for r in members(entry.ps))]
        if not lacking:
            return []
        _, _, name, entry = min(lacking)
        absent = [r for r in members(entry.ps) if r not in entry.sigs]
        waits_on: Dict[int, List[str]] = {}
        for other, e in table.items():
            for r in e.sigs:
                waits_on.setdefault(r, []).append(other)
        elsewhere = "; ".join(f"rank {r} started {', '.join(repr(n) for n in waits_on.get(r, []))[:200] or 'nothing'}"
                              for r in absent)
        error = CollectiveMismatchError(
            f"deadlock: {entry.kind} {name!r} was started by {format_ranks(sorted(entry.sigs))} but not by "
            f"{format_ranks(absent)}, and every rank has waited {DEADLOCK_S:.0f} s for a request that cannot "
            f"complete ({elsewhere}); it fails so the others can go on (the ranks called collectives in a "
            f"different order, e.g. one left a loop of collectives early)")
        return [(name, entry, error)]


def noname_counter(name: str) -> Optional[Tuple[Tuple[str, int], int]]:
    """``((kind, process set), n)`` of an unnamed request's name ``kind.noname.<ps>.<n>``, else None."""
    kind, tag, ps, n = (name.split(".") + ["", "", ""])[:4]
    if tag == "noname" and ps.isdigit() and n.split("@")[0].isdigit():
        return (kind, int(ps)), int(n.split("@")[0])
    return None


def started_all_open(table: Dict, rank: int, members) -> bool:
    """Whether some request is open and ``rank`` has started every open one it belongs to.

    Such a rank cannot add anything: it enters the next cycle at once and
    waits inside the exchange, so the cycle completes as soon as the last
    rank starts the request (which wakes that rank's thread at once),
    instead of up to ``HOROVOD_CYCLE_TIME`` later when this rank's pause
    ends.  The ranks that have yet to start a request keep pausing, so
    ranks that wait on each other's requests never spin.
    """
    waiting = False
    for entry in table.values():
        if rank not in members(entry.ps):
            continue
        if rank not in entry.sigs:
            return False
        waiting = True
    return waiting
