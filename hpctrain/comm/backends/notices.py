"""How a backend's ranks send and receive leaving notices (:mod:`hpctrain.comm.life.departures` is the board that
collects them): MPI messages (:class:`MPINotices`: the MPI backend, and Horovod under its MPI controller) or the
key-value store of ``horovodrun --gloo``'s rendezvous server (:class:`KVNotices`)."""
from __future__ import annotations

from typing import List, Tuple

import numpy as np

from .mpi import ulfm

__all__ = ["MPINotices", "KVNotices"]

_TAG_LEAVING = 1


class MPINotices:
    """Leaving notices over MPI: one 16-byte message (rank, exit status) to every other rank, on a communicator of
    their own.

    Matched probes (``MPI_Improbe``) take each notice off the queue exactly
    once, whichever thread looks.
    """

    def __init__(self, comm, MPI):
        self._comm, self._MPI = comm.Dup(), MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def announce(self, exit_status: int = 0) -> None:
        """Tell every other rank that this one is leaving (the sends complete locally: 16 bytes each)."""
        me = np.array([self.rank, exit_status], dtype=np.int64)
        reqs = [self._comm.Isend(me, dest=r, tag=_TAG_LEAVING) for r in range(self.size) if r != self.rank]
        self._MPI.Request.Waitall(reqs)

    def poll(self) -> List[Tuple[int, int]]:
        """(rank, exit status) of the notices that have arrived since the last poll."""
        out, buf, status = [], np.zeros(2, dtype=np.int64), self._MPI.Status()
        acked = False
        while True:
            try:
                msg = self._comm.Improbe(source=self._MPI.ANY_SOURCE, tag=_TAG_LEAVING, status=status)
            except self._MPI.Exception:
                # Under MPI's fault-tolerance extension a wildcard probe fails until this rank has
                # acknowledged the processes that failed (they are named elsewhere: failures.py).
                if acked or not ulfm.acknowledge(self._comm):
                    return out
                acked = True
                continue
            if msg is None:
                return out
            msg.Recv(buf)
            out.append((int(buf[0]), int(buf[1])))

    def free(self) -> None:
        """Release the communicator (after every other rank has left too)."""
        self._comm.Free()


class KVNotices:
    """Leaving notices through a key-value store over HTTP (the rendezvous server of ``horovodrun --gloo``).

    A leaving rank PUTs ``/<scope>/left-<rank>`` (its exit status); ``poll`` GETs the key of
    every rank not yet known to have left (404: still running).  Cost: one
    HTTP request per other rank and poll; the watchdog polls only while a
    collective has waited a second or more.
    """

    def __init__(self, addr: str, port: int, rank: int, size: int, scope: str = "hpctrain-departures"):
        self.rank, self.size = rank, size
        self._base = f"http://{addr}:{port}/{scope}"
        self._known: set = set()

    def announce(self, exit_status: int = 0) -> None:
        """PUT this rank's key, its exit status as the value."""
        from urllib.request import Request, urlopen

        req = Request(f"{self._base}/left-{self.rank}", data=str(int(exit_status)).encode(), method="PUT")
        urlopen(req, timeout=10).close()

    def poll(self) -> List[Tuple[int, int]]:
        """(rank, exit status) of the keys that appeared since the last poll."""
        from urllib.error import HTTPError, URLError
        from urllib.request import urlopen

        out = []
        for r in range(self.size):
            if r == self.rank or r in self._known:
                continue
            try:
                with urlopen(f"{self._base}/left-{r}", timeout=10) as reply:
                    text = reply.read().decode(errors="replace").strip()
            except HTTPError as exc:
                if exc.code == 404:
                    continue
                raise
            except URLError:
                continue          # the store is gone: the launcher is ending the job anyway
            self._known.add(r)
            out.append((r, int(text) if text.lstrip("-").isdigit() else 0))
        return out
