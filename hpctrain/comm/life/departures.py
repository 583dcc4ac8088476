"""Ranks that have left the world: each rank's notice that it is leaving, and the board that collects them.

A rank leaves when it shuts hpctrain down: ``hpctrain.shutdown()``, or, at
interpreter exit, the ``atexit`` hook that ``init()`` installs (the script
returned, called ``sys.exit(0)``, or finished its loop early).  It first
sends every other rank a notice, then waits until every other rank has left
too before it frees anything collective, so ranks that finish together leave
together, as fast as before; a rank that waits longer than
``HPCTRAIN_STALL_TIMEOUT_S`` for the others to leave ends the job, naming
them.  The notice carries the rank's exit status (``sys.exit(3)`` after
``init()``), so a rank that waits for it ends the job with that status.  A rank still waiting in a collective that a
departed rank belongs to will never see it join: the watchdog
(:mod:`hpctrain.comm.life.runtime`) reads the board and ends the job with a message
naming the ranks that left and the call it waits in, a few seconds after the
notice arrived (:data:`GRACE_S`, so a call the leaver had already finished
can complete).

Transports (:mod:`hpctrain.comm.backends.notices`): MPI messages (``MPINotices``: the MPI backend, and Horovod
under its MPI controller) or the key-value store of ``horovodrun --gloo``'s
rendezvous server (``KVNotices``).  Cost: ``N - 1`` notices (16 bytes) sent per rank
at shutdown (``N (N - 1)`` in all), and a poll per watchdog period while a
collective has waited a second or more.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Iterable, List, Tuple

__all__ = ["Departures", "GRACE_S"]

log = logging.getLogger("hpctrain")

GRACE_S = 3.0          # how long a call may still run after a rank it waits for has left


class Departures:
    """The world ranks known to have left, with when this rank learnt of it (``time.monotonic()``).

    Args:
        rank, size: this rank and the world's size.
        poll: returns ``(world rank, exit status)`` of the notices that
            arrived since the last call (the backend's transport); called by
            the watchdog and at shutdown, never at the same time.
        announce: sends this rank's notice, with its exit status, to every other rank.
        free: releases the transport once every rank has left.
    """

    def __init__(self, rank: int, size: int, poll: Callable[[], Iterable[Tuple[int, int]]],
                 announce: Callable[[int], None], free: Callable[[], None] = lambda: None):
        self.rank, self.size = rank, size
        self._poll, self._announce, self._free = poll, announce, free
        self._lock = threading.Lock()
        self.left: Dict[int, float] = {}
        self.status: Dict[int, int] = {}     # exit status each departed rank announced

    def leave(self, warn_after: float, give_up_after: float = 0.0, exit_status: int = 0,
              gone: Iterable[int] = ()) -> List[int]:
        """Announce that this rank leaves, wait until every other rank (but the failed ones, ``gone``) has left
        too, then free the transport.

        Says once, after ``warn_after`` seconds, which ranks are still running.
        Returns the ranks still running after ``give_up_after`` seconds (0:
        wait for ever), without freeing the transport; else an empty list.
        """
        from ...errors import format_ranks

        self._announce(int(exit_status))
        rank, start, warned = self.rank, time.monotonic(), False
        others = set(range(self.size)) - {self.rank} - set(gone)
        while not others <= set(self.update()):
            waited = time.monotonic() - start
            if give_up_after and waited >= give_up_after:
                return sorted(others - set(self.left))
            if not warned and waited >= warn_after:
                log.warning("hpctrain: rank %d has finished and waits for %s to finish too", rank,
                            format_ranks(sorted(others - set(self.left))))
                warned = True
            time.sleep(min(0.25, 0.005 + waited / 20))   # soon, then every 0.25 s
        with self._lock:               # the watchdog may still be about to poll: make that a no-op first
            self._poll = tuple
            self._free()
        return []

    def update(self) -> Dict[int, float]:
        """Read the notices that arrived and return every departure known so far."""
        with self._lock:
            for rank, status in self._poll():
                if int(rank) not in self.left:
                    self.left[int(rank)] = time.monotonic()
                    self.status[int(rank)] = int(status)
        return self.left

    def describe(self, ranks: Iterable[int]) -> str:
        """Say how ``ranks`` left: "world rank 2 exited with status 3", or "... left the job (returned, ...)"."""
        from ...errors import format_ranks

        ranks = sorted(ranks)
        parts = [f"world rank {r} exited with status {self.status[r]}" for r in ranks if self.status.get(r)]
        rest = [r for r in ranks if not self.status.get(r)]
        if rest:
            parts.append(f"world {format_ranks(rest)} left the job (returned, exited or called hpctrain.shutdown())")
        return "; ".join(parts)

    def exit_status(self, ranks: Iterable[int]) -> int:
        """The status to end the job with for ``ranks``' departure: the first non-zero one they announced, else 1."""
        return next((self.status[r] for r in sorted(ranks) if self.status.get(r)), 1)

    def blocking(self, members: Iterable[int], since: float, now: float) -> List[int]:
        """The departed ranks among ``members`` whose notice is older than ``GRACE_S`` (and than ``since``)."""
        return sorted(r for r in members if r in self.left and now - max(self.left[r], since) >= GRACE_S)
