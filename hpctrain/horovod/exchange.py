"""The negotiation cycle's exchange: an allgather of small messages that waits without spinning.

A negotiation cycle (:mod:`hpctrain.horovod.controller`) runs while the
training thread computes.  A blocking MPI collective busy-polls the CPU
while it waits for the slowest rank, taking a core from the computation, so
on the MPI backend the cycle uses a communicator of its own (a ``Dup`` of
the world's) with non-blocking ``Iallgather`` and a wait that polls a few
times and then sleeps between tests, 50 us at first, doubling up to 2 ms
(a rank that waits long for the others wakes rarely).  Each rank sends a fixed slot
of ``SLOT`` bytes (8 of them the message length); a message that does not
fit travels in a second ``Iallgatherv``.  While it waits longer than a
second it reads the departures board (:mod:`hpctrain.comm.departures`) and
raises, naming them, when ranks it waits for have left.  Other backends use
the world's ``allgather_object``.

Cost per cycle: one allgather of ``SLOT`` x ranks bytes; when the last rank
arrives late, up to about half its delay (at most 2 ms) more than a
spinning wait.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, List

import numpy as np

from ..comm.signature import format_ranks

__all__ = ["CycleExchange", "SLOT"]

SLOT = 2048
_SPINS = 50
_SLEEP_S = 5e-5
_MAX_SLEEP_S = 2e-3


class CycleExchange:
    """Allgather picklable objects over ``world`` (see the module docstring)."""

    def __init__(self, world):
        self.world = world
        base = getattr(world, "_base", None) if world.backend == "mpi" else None
        self.comm = base.Dup() if base is not None else None
        if self.comm is not None:
            from mpi4py import MPI
            self._MPI = MPI
            self._send = np.zeros(SLOT, np.uint8)
            self._recv = np.zeros(SLOT * world.size, np.uint8)

    def allgather(self, obj: Any, poll: bool = True) -> List[Any]:
        """Return every rank's ``obj``, in rank order.

        ``poll=False`` (an idle cycle: this rank waits for nothing of its
        own) skips the first polls and sleeps at once: an idle cycle then
        costs each rank a few microseconds of its core instead of the polls'.
        """
        if self.comm is None:
            return self.world.allgather_object(obj)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        self._send[:8] = np.frombuffer(np.int64(n).tobytes(), np.uint8)
        if n <= SLOT - 8:
            self._send[8:8 + n] = np.frombuffer(data, np.uint8)
        self._wait(self.comm.Iallgather(self._send, self._recv), _SPINS if poll else 1)
        slots = self._recv.reshape(self.world.size, SLOT)
        sizes = slots[:, :8].copy().view(np.int64).ravel()
        if int(sizes.max()) <= SLOT - 8:
            return [pickle.loads(slots[r, 8:8 + s].tobytes()) for r, s in enumerate(sizes)]
        big = np.zeros(int(sizes.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._wait(self.comm.Iallgatherv(np.frombuffer(data, np.uint8),
                                         [big, sizes, displs, self._MPI.BYTE]))
        return [pickle.loads(big[d:d + s].tobytes()) for d, s in zip(displs, sizes)]

    def _wait(self, req, spins: int = _SPINS) -> None:
        for _ in range(spins):
            if req.Test():
                return
        start = last = time.monotonic()
        pause = _SLEEP_S
        while not req.Test():
            time.sleep(pause)
            pause = min(2 * pause, _MAX_SLEEP_S)
            now = time.monotonic()
            if now - last > 1.0:
                last = now
                self._check_departures(start, now)

    def _check_departures(self, since: float, now: float) -> None:
        board = getattr(self.world._rt, "departures", None)
        if board is None:
            return
        board.update()
        gone = board.blocking(range(self.world.size), since, now)
        if gone:
            from .controller import HorovodInternalError
            raise HorovodInternalError(f"world {format_ranks(gone)} left the job while this rank "
                                       f"({self.world.rank}) negotiates Horovod collectives with it")

    def free(self) -> None:
        """Release the exchange's communicator."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
