"""What a communicator hands out: a handle on a call in flight, the node layout, work that is carried by the call check."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from .signature import Call

__all__ = ["Handle", "Waitable", "Plan", "CarriedByCheck", "Topology", "done_handle", "same"]

# A planned call: (its description for the call check, the work (None if the call is invalid), the restore step)
Plan = Tuple[Call, Optional[Callable[[], Any]], Callable[[Any], Any]]


def same(x):
    """Return ``x`` (the restore step of a result that needs no conversion)."""
    return x


class CarriedByCheck:
    """Work whose input travels with the call check (one exchange instead of two; see :mod:`hpctrain.comm.backends.mpi.mailbox`).

    ``payload`` (any shape, cast to ``dtype`` on the way) is posted with the
    call; where it is None, ``announce`` bytes are announced instead (what
    the rank would have sent, for the peers to size the exchange that
    follows).  ``finish()``, run once every rank's call and payload have
    arrived, returns the result.
    """

    __slots__ = ("payload", "dtype", "finish", "announce")

    def __init__(self, payload: Optional[np.ndarray], dtype: Optional[np.dtype], finish: Callable[[], Any],
                 announce: int = 0):
        self.payload, self.dtype, self.finish, self.announce = payload, dtype, finish, announce


@runtime_checkable
class Waitable(Protocol):
    """What every handle on a call in flight offers (whatever the backend: MPI, Horovod, negotiated).

    ``wait(timeout)`` returns the result or raises the call's error; with a
    ``timeout`` (seconds) that passes first it raises :class:`TimeoutError` and
    the call stays in flight (wait again).  ``test()`` says whether ``wait``
    would return at once.
    """

    def wait(self, timeout: Optional[float] = None) -> Any: ...

    def test(self) -> bool: ...


def done_handle(value: Any = None) -> "Handle":
    """Return a handle that has already finished with ``value``."""
    fut: Future = Future()
    fut.set_result(value)
    return Handle(fut, same)


class Handle:
    """A call in flight (a :class:`Waitable`).  ``wait()`` returns its result (or raises its error); ``test()`` polls.

    ``log``: a :class:`~hpctrain.comm.recording.comm_log.CommLog` that is told how long ``wait()`` blocked.
    """

    def __init__(self, future: Future, restore: Callable[[Any], Any], log=None):
        self._future = future
        self._restore = restore
        self._log = log

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the collective has finished and return its result in the input's type."""
        if self._log is None or self._future.done():
            return self._restore(self._future.result(timeout))
        start = time.perf_counter()
        try:
            value = self._future.result(timeout)
        finally:
            self._log.add_blocked(time.perf_counter() - start)
        return self._restore(value)

    def test(self) -> bool:
        """Return True when the collective has finished (``wait()`` will not block)."""
        return self._future.done()


@dataclass(frozen=True)
class Topology:
    """Where this process sits: its rank on its node and its node's index."""

    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
