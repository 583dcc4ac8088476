"""The negotiation cycle's exchange: an allgather of small messages that waits without spinning, and doorbells.

A negotiation cycle (:mod:`hpctrain.horovod.controller`) runs while the
training thread computes.  A blocking MPI collective busy-polls the CPU
while it waits for the slowest rank, taking a core from the computation, so
on the MPI backend the cycle uses a communicator of its own (a ``Dup`` of
the world's) with non-blocking ``Iallgather`` and a wait that polls a few
times and then sleeps between tests: 50 us at first, doubling up to 100 us
while this rank waits for a request of its own (the ranks' skew in starting
the same request is often a millisecond, and a longer sleep would add up to
half of it) and for the first 10 ms, then up to 2 ms (a rank that waits long
for the others, or only takes part, wakes rarely).  Each rank sends a fixed
slot of ``SLOT`` bytes (8 of them the message length); a message that does
not fit travels in a second ``Iallgatherv``.  While it waits longer than a
second it reads the departures board (:mod:`hpctrain.comm.life.departures`) and
raises, naming them, when ranks it waits for have left.  Where Horovod
carries the job the cycle is one Horovod allgather of the pickled messages
(``gather_bytes``: no call check of hpctrain's around it); other backends use
the world's ``allgather_object``.

Doorbells let ranks skip cycles while nothing is open: a rank that has
something to negotiate :meth:`ring` s the others with the number of the
cycle it is about to enter and whether they must come at once or may wait
for a request of their own (one 8-byte message to each, on the same
communicator), and a waiting rank checks :meth:`rung` with a ``Test``
instead of running a whole cycle.  Only the MPI backend has them.

Cost per cycle: one allgather of ``SLOT`` x ranks bytes; when the last rank
arrives late, up to about half its delay (at most 100 us in the first 10 ms,
then at most 2 ms) more than a spinning wait.  A ring: ranks - 1 messages.
"""
from __future__ import annotations

import pickle
import time
from typing import Any, List, Tuple

import numpy as np

__all__ = ["CycleExchange", "SLOT"]

SLOT = 2048
_SPINS = 50
_SLEEP_S = 5e-5
_BUSY_SLEEP_S = 1e-4       # the longest sleep while this rank waits for its own request, in the first ...
_BUSY_S = 0.01             # ... 10 ms of the wait
_MAX_SLEEP_S = 2e-3
_DOORBELL_TAG = 0x4844      # point-to-point on the exchange's own communicator: no other messages there


def _finished(req) -> bool:
    """Whether a doorbell's send completed (then it is freed).

    ``MPI_Request_get_status`` first, not a test: under Open MPI's
    fault-tolerance extension a test frees a send to a failed rank while its
    message may still sit in the network layer, and the process ends when
    that message fails later (:mod:`hpctrain.comm.backends.mpi.requests`); a send the
    library completed is safe to free, with or without an error.
    """
    if not req.Get_status():
        return False
    req.Wait()
    return True


class CycleExchange:
    """Allgather picklable objects over ``world`` (see the module docstring)."""

    def __init__(self, world):
        self.world = world
        base = world.mpi_comm if world.backend == "mpi" else None
        self.comm = base.Dup() if base is not None else None
        if self.comm is not None:
            from mpi4py import MPI
            self._MPI = MPI
            self._send = np.zeros(SLOT, np.uint8)
            self._recv = np.zeros(SLOT * world.size, np.uint8)
            self._bell = np.zeros(1, np.int64)
            self._bell_req = self.comm.Irecv(self._bell, source=MPI.ANY_SOURCE, tag=_DOORBELL_TAG)
            self._rings: List[Any] = []            # sends not known to be complete (with their buffers)
            # (elastic mode: a failed rank revokes it with the world's own)
            self._forget_revoke = world.life.failure_policy.on_revoke(self.comm.Revoke)

    @property
    def has_doorbells(self) -> bool:
        """Whether :meth:`ring` and :meth:`rung` work (the MPI backend); else every rank runs every cycle."""
        return self.comm is not None

    def ring(self, cycle: int, urgent=()) -> None:
        """Tell every other rank to enter cycle ``cycle`` (non-blocking sends of one int64 each).

        Ranks in ``urgent`` are told to come at once, the others that they may
        first wait for a request of their own (see :meth:`rung`).
        """
        self._rings = [(req, buf) for req, buf in self._rings if not _finished(req)]
        for r in range(self.world.size):
            if r != self.world.rank:
                buf = np.array([2 * cycle + (r in urgent)], np.int64)
                self._rings.append((self.comm.Isend(buf, dest=r, tag=_DOORBELL_TAG), buf))

    def rung(self) -> Tuple[int, int]:
        """Return the highest cycle numbers rung since the last call, of all bells and of urgent ones (-1: none).

        Never blocks.
        """
        highest = urgent = -1
        while self._bell_req.Test():
            cycle, at_once = divmod(int(self._bell[0]), 2)
            highest = max(highest, cycle)
            urgent = max(urgent, cycle) if at_once else urgent
            self._bell_req = self.comm.Irecv(self._bell, source=self._MPI.ANY_SOURCE, tag=_DOORBELL_TAG)
        return highest, urgent

    def allgather(self, obj: Any, poll: bool = True) -> List[Any]:
        """Return every rank's ``obj``, in rank order.

        ``poll=False`` (an idle cycle: this rank waits for nothing of its
        own) skips the first polls and sleeps at once: an idle cycle then
        costs each rank a few microseconds of its core instead of the polls'.
        """
        if self.comm is None:
            gather = self.world.gather_bytes     # (where Horovod carries the job: one op; else None)
            if gather is None:
                return self.world.allgather_object(obj)
            blobs = gather(np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8),
                           "hpctrain.horovod.cycle")
            return [pickle.loads(b) for b in blobs]
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        n = len(data)
        self._send[:8] = np.frombuffer(np.int64(n).tobytes(), np.uint8)
        if n <= SLOT - 8:
            self._send[8:8 + n] = np.frombuffer(data, np.uint8)
        self._wait(self.comm.Iallgather(self._send, self._recv), _SPINS if poll else 1, poll)
        slots = self._recv.reshape(self.world.size, SLOT)
        sizes = slots[:, :8].copy().view(np.int64).ravel()
        if int(sizes.max()) <= SLOT - 8:
            return [pickle.loads(slots[r, 8:8 + s].tobytes()) for r, s in enumerate(sizes)]
        big = np.zeros(int(sizes.sum()), np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._wait(self.comm.Iallgatherv(np.frombuffer(data, np.uint8),
                                         [big, sizes, displs, self._MPI.BYTE]))
        return [pickle.loads(big[d:d + s].tobytes()) for d, s in zip(displs, sizes)]

    def _wait(self, req, spins: int = _SPINS, busy: bool = True) -> None:
        for _ in range(spins):
            if req.Test():
                return
        start = last = time.monotonic()
        pause = _SLEEP_S
        while not req.Test():
            time.sleep(pause)
            now = time.monotonic()
            pause = min(2 * pause, _BUSY_SLEEP_S if busy and now - start < _BUSY_S else _MAX_SLEEP_S)
            if now - last > 1.0:
                last = now
                self._check_departures(start, now)

    def _check_departures(self, since: float, now: float) -> None:
        gone = self.world.life.left_while_waiting(range(self.world.size), since, now)
        if gone:
            from .pending import HorovodInternalError
            raise HorovodInternalError(f"{gone} while this rank ({self.world.rank}) negotiates Horovod collectives "
                                       f"with it")

    def free(self) -> None:
        """Release the exchange's communicator."""
        if self.comm is not None:
            self._forget_revoke()
            self._bell_req.Cancel()
            self._bell_req.Wait()
            for req, _ in self._rings:
                req.Wait()
            self.comm.Free()
            self.comm = None
