"""Point-to-point pieces of the MPI backend: the ring algorithms' transport and handles on MPI requests."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..handle import Handle

__all__ = ["RingTransport", "RequestHandle", "TAG_RING"]

TAG_RING = 3        # (the MPI backend's call check uses tags 1 and 2 on another communicator)


class RingTransport:
    """The point-to-point transport of :mod:`hpctrain.collectives.ring` over one MPI communicator."""

    def __init__(self, comm, MPI):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._comm, self._waitall = comm, MPI.Request.Waitall

    def isend(self, buf: np.ndarray, dest: int):
        return self._comm.Isend(buf, dest, TAG_RING)

    def irecv(self, buf: np.ndarray, source: int):
        return self._comm.Irecv(buf, source, TAG_RING)

    def waitall(self, reqs) -> None:
        if reqs:
            self._waitall(reqs)


class RequestHandle(Handle):
    """A handle over MPI requests; keeps the buffers alive until they complete."""

    def __init__(self, reqs, buffers, MPI):
        self._reqs, self._buffers, self._MPI = reqs, buffers, MPI

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the send has completed (its buffer may be reused)."""
        self._MPI.Request.Waitall(self._reqs)
        self._buffers = None

    def test(self) -> bool:
        """Return True when the send has completed."""
        return bool(self._MPI.Request.Testall(self._reqs))
