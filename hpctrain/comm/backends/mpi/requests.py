"""Point-to-point pieces of the MPI backend: waiting on requests, the ring algorithms' transport, and handles on
MPI requests.

Elastic mode waits differently.  Under Open MPI's fault-tolerance extension a
request whose peer failed is completed for MPI (with an error) by the wait
call itself while its fragments may still sit in the network layer, and the
wait's error path frees it; when such a fragment then fails, the process ends
("Send error after request freed", fatal on no communicator): a survivor of a
lost node could die of its own wait.  :class:`Waits` in elastic mode therefore
polls ``MPI_Request_get_status``, which neither fails nor frees a request, and
frees a request (``Waitall``) only once the library completed it; when a
failure is known while requests are pending it leaves them allocated for the
life of the process (as Open MPI's own collectives do) and raises
``MPI_ERR_PROC_FAILED``.
"""
from __future__ import annotations

import time
from typing import List, Optional

import numpy as np

from ...call.handle import Handle
from ....waiting import wait_until

__all__ = ["Waits", "RingTransport", "RequestHandle", "TAG_RING", "failure_classes"]

TAG_RING = 3        # (the MPI backend's call check uses tags 1 and 2 on another communicator)
_FAILURE_POLL_S = 0.01    # elastic mode: how often a wait asks whether a rank failed

# Requests left pending by a failure (elastic mode), with their buffers: never freed (module docstring).
_KEPT: list = []


class Waits:
    """Wait on MPI requests: MPI's own calls, or in elastic mode (``runtime`` given) a poll that never has MPI
    free a request it has not finished (module docstring).

    While requests are pending the poll asks ``runtime.policy.failure_known()``
    every ``_FAILURE_POLL_S``.  Where the program handles failures itself
    (``on_rank_failure``: a parameter server going on without a lost worker,
    on the same communicators) MPI's own calls wait, as outside elastic mode.
    Cost in elastic mode: one ``MPI_Request_get_status`` per pending request
    per pass, from Python.
    """

    def __init__(self, MPI, runtime=None):
        self._MPI, self._rt = MPI, runtime

    def _polls(self) -> bool:
        return self._rt is not None and self._rt.policy.polls_requests

    def all(self, reqs, statuses=None) -> None:
        """Wait until every request of ``reqs`` completed (``MPI_Waitall``).

        In elastic mode a request that a peer's failure completed makes
        ``MPI_Waitall`` fail with ``MPI_ERR_IN_STATUS``, the failure in its
        status: that is raised as ``MPI_ERR_PROC_FAILED`` (a rank failed), not
        as an error of the program's own.
        """
        if not self._polls():
            self._MPI.Request.Waitall(reqs, statuses)
            return
        self._poll(reqs, every=True)
        MPI = self._MPI
        statuses = [MPI.Status() for _ in reqs] if statuses is None else statuses
        try:
            MPI.Request.Waitall(reqs, statuses)
        except MPI.Exception as exc:
            if exc.Get_error_class() == MPI.ERR_IN_STATUS and any(
                    MPI.Get_error_class(st.Get_error()) in failure_classes(MPI) for st in statuses):
                raise MPI.Exception(MPI.ERR_PROC_FAILED) from exc
            raise

    def some(self, reqs) -> List[int]:
        """Wait until at least one request of ``reqs`` completed; the indices of those that did (``MPI_Waitsome``)."""
        if not self._polls():
            return self._MPI.Request.Waitsome(reqs) or []
        done = self._poll(reqs, every=False)
        for i in done:
            reqs[i].Wait()
        return done

    def test(self, reqs) -> bool:
        """Whether every request of ``reqs`` completed (then they are freed: ``MPI_Testall``)."""
        if not self._polls():
            return bool(self._MPI.Request.Testall(reqs))
        if any(r and not r.Get_status() for r in reqs):
            self._check(reqs)
            return False
        self._MPI.Request.Waitall(reqs)
        return True

    def _poll(self, reqs, every: bool) -> List[int]:
        asked = time.monotonic()
        while True:
            done, pending = [], False
            for i, r in enumerate(reqs):
                if r:                               # (a finished request is MPI_REQUEST_NULL)
                    if r.Get_status():
                        done.append(i)
                    else:
                        pending = True
            if not pending or (done and not every):
                return done
            if time.monotonic() - asked >= _FAILURE_POLL_S:
                self._check(reqs)
                asked = time.monotonic()

    def _check(self, reqs) -> None:
        """Raise MPI_ERR_PROC_FAILED, keeping ``reqs``, once a rank is known to have failed."""
        if self._rt.policy.failure_known():
            _KEPT.extend(r for r in reqs if r)
            raise self._MPI.Exception(self._MPI.ERR_PROC_FAILED)


def failure_classes(MPI) -> set:
    """The error classes that say a rank failed (Open MPI's fault-tolerance extension)."""
    return {getattr(MPI, n) for n in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED") if hasattr(MPI, n)}


class RingTransport:
    """The point-to-point transport of :mod:`hpctrain.collectives.ring` over one MPI communicator."""

    def __init__(self, comm, waits: Waits):
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._comm, self._waits = comm, waits

    def isend(self, buf: np.ndarray, dest: int):
        return self._comm.Isend(_bytes_of(buf), dest, TAG_RING)

    def irecv(self, buf: np.ndarray, source: int):
        return self._comm.Irecv(_bytes_of(buf), source, TAG_RING)

    def waitall(self, reqs) -> None:
        if reqs:
            self._waits.all(reqs)


def _bytes_of(buf: np.ndarray) -> np.ndarray:
    """``buf`` as MPI can take it: a dtype numpy has no buffer format for (ml_dtypes' bfloat16) as its bytes."""
    return buf.view(np.uint16) if buf.dtype.kind == "V" and buf.dtype.itemsize == 2 else buf


class RequestHandle(Handle):
    """A handle over MPI requests; keeps the buffers alive until they complete."""

    def __init__(self, reqs, buffers, waits: Waits):
        self._reqs, self._buffers, self._waits = reqs, buffers, waits

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the send has completed (its buffer may be reused); TimeoutError after ``timeout`` s."""
        wait_until(self.test, timeout, "the send")
        self._waits.all(self._reqs)
        self._buffers = None

    def test(self) -> bool:
        """Return True when the send has completed."""
        return self._waits.test(self._reqs)
