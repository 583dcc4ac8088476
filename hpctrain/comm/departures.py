"""Ranks that have left the world: each rank's notice that it is leaving, and the board that collects them.

A rank leaves when it shuts hpctrain down: ``hpctrain.shutdown()``, or, at
interpreter exit, the ``atexit`` hook that ``init()`` installs (the script
returned, called ``sys.exit(0)``, or finished its loop early).  It first
sends every other rank a notice, then waits until every other rank has left
too before it frees anything collective, so ranks that finish together leave
together, as fast as before.  A rank still waiting in a collective that a
departed rank belongs to will never see it join: the watchdog
(:mod:`hpctrain.comm.runtime`) reads the board and ends the job with a message
naming the ranks that left and the call it waits in, a few seconds after the
notice arrived (:data:`GRACE_S`, so a call the leaver had already finished
can complete).

Transports: MPI messages (:class:`MPINotices`: the MPI backend, and Horovod
under its MPI controller) or the key-value store of ``horovodrun --gloo``'s
rendezvous server (:class:`KVNotices`).  Cost: ``N - 1`` notices sent per rank
at shutdown (``N (N - 1)`` in all), and a poll per watchdog period while a
collective has waited a second or more.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Iterable, List

import numpy as np

__all__ = ["Departures", "MPINotices", "KVNotices", "GRACE_S"]

log = logging.getLogger("hpctrain")

GRACE_S = 3.0          # how long a call may still run after a rank it waits for has left
_TAG_LEAVING = 1


class Departures:
    """The world ranks known to have left, with when this rank learnt of it (``time.monotonic()``).

    Args:
        rank, size: this rank and the world's size.
        poll: returns the world ranks whose notices arrived since the last
            call (the backend's transport); called by the watchdog and at
            shutdown, never at the same time.
        announce: sends this rank's notice to every other rank.
        free: releases the transport once every rank has left.
    """

    def __init__(self, rank: int, size: int, poll: Callable[[], Iterable[int]], announce: Callable[[], None],
                 free: Callable[[], None] = lambda: None):
        self.rank, self.size = rank, size
        self._poll, self._announce, self._free = poll, announce, free
        self._lock = threading.Lock()
        self.left: Dict[int, float] = {}

    def leave(self, warn_after: float) -> None:
        """Announce that this rank leaves, wait until every other rank has left too, then free the transport.

        Says once, after ``warn_after`` seconds, which ranks are still running.
        """
        self._announce()
        rank, others, start, warned = self.rank, set(range(self.size)) - {self.rank}, time.monotonic(), False
        while not others <= set(self.update()):
            if not warned and time.monotonic() - start >= warn_after:
                from .signature import format_ranks

                log.warning("hpctrain: rank %d has finished and waits for %s to finish too", rank,
                            format_ranks(sorted(others - set(self.left))))
                warned = True
            time.sleep(min(0.25, 0.005 + (time.monotonic() - start) / 20))   # soon, then every 0.25 s
        with self._lock:               # the watchdog may still be about to poll: make that a no-op first
            self._poll = tuple
            self._free()

    def update(self) -> Dict[int, float]:
        """Read the notices that arrived and return every departure known so far."""
        with self._lock:
            for rank in self._poll():
                self.left.setdefault(int(rank), time.monotonic())
        return self.left

    def blocking(self, members: Iterable[int], since: float, now: float) -> List[int]:
        """The departed ranks among ``members`` whose notice is older than ``GRACE_S`` (and than ``since``)."""
        return sorted(r for r in members if r in self.left and now - max(self.left[r], since) >= GRACE_S)


class MPINotices:
    """Leaving notices over MPI: one 8-byte message to every other rank, on a communicator of their own.

    Matched probes (``MPI_Improbe``) take each notice off the queue exactly
    once, whichever thread looks.
    """

    def __init__(self, comm, MPI):
        self._comm, self._MPI = comm.Dup(), MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def announce(self) -> None:
        """Tell every other rank that this one is leaving (the sends complete locally: 8 bytes each)."""
        me = np.array([self.rank], dtype=np.int64)
        reqs = [self._comm.Isend(me, dest=r, tag=_TAG_LEAVING) for r in range(self.size) if r != self.rank]
        self._MPI.Request.Waitall(reqs)

    def poll(self) -> List[int]:
        """The ranks whose notices have arrived since the last poll."""
        out, buf, status = [], np.zeros(1, dtype=np.int64), self._MPI.Status()
        while True:
            msg = self._comm.Improbe(source=self._MPI.ANY_SOURCE, tag=_TAG_LEAVING, status=status)
            if msg is None:
                return out
            msg.Recv(buf)
            out.append(int(buf[0]))

    def free(self) -> None:
        """Release the communicator (after every other rank has left too)."""
        self._comm.Free()


class KVNotices:
    """Leaving notices through a key-value store over HTTP (the rendezvous server of ``horovodrun --gloo``).

    A leaving rank PUTs ``/<scope>/left-<rank>``; ``poll`` GETs the key of
    every rank not yet known to have left (404: still running).  Cost: one
    HTTP request per other rank and poll; the watchdog polls only while a
    collective has waited a second or more.
    """

    def __init__(self, addr: str, port: int, rank: int, size: int, scope: str = "hpctrain-departures"):
        self.rank, self.size = rank, size
        self._base = f"http://{addr}:{port}/{scope}"
        self._known: set = set()

    def announce(self) -> None:
        """PUT this rank's key."""
        from urllib.request import Request, urlopen

        req = Request(f"{self._base}/left-{self.rank}", data=b"1", method="PUT")
        urlopen(req, timeout=10).close()

    def poll(self) -> List[int]:
        """The ranks whose keys appeared since the last poll."""
        from urllib.error import HTTPError, URLError
        from urllib.request import urlopen

        out = []
        for r in range(self.size):
            if r == self.rank or r in self._known:
                continue
            try:
                urlopen(f"{self._base}/left-{r}", timeout=10).close()
            except HTTPError as exc:
                if exc.code == 404:
                    continue
                raise
            except URLError:
                continue          # the store is gone: the launcher is ending the job anyway
            self._known.add(r)
            out.append(r)
        return out
