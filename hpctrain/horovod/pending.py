"""The records of Horovod's negotiation: a request's handle, a started request, an entry of the shared table.

:mod:`hpctrain.horovod.controller` keeps them; the API functions hand out
:class:`OpHandle` s and raise :class:`HorovodInternalError`.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

from ..errors import HpctrainError, WorldFailedError

__all__ = ["HorovodInternalError", "WorldFailedInHorovod", "OpHandle", "Request", "Entry"]


class HorovodInternalError(HpctrainError):
    """Horovod's error for a collective that could not complete (shut down, or a rank lost)."""


class WorldFailedInHorovod(HorovodInternalError, WorldFailedError):
    """Ranks failed in elastic mode: Horovod's ``HorovodInternalError`` (what ``hvd.elastic.run`` catches) and
    hpctrain's :class:`~hpctrain.errors.WorldFailedError` (what ``hpctrain.elastic.run`` catches) at once."""


class OpHandle:
    """The pending result of one request: ``done()`` (``test()``), ``wait(timeout=None)``."""

    __slots__ = ("_event", "_value", "_error", "name", "owner")

    def __init__(self, name: str, owner=None):
        self._event, self._value, self._error, self.name = threading.Event(), None, None, name
        self.owner = owner          # told when a thread starts and stops waiting (``blocked(+1/-1)``)

    def done(self) -> bool:
        """Return whether the request has finished (successfully or not)."""
        return self._event.is_set()

    def test(self) -> bool:
        """``done()`` under the name every hpctrain handle has (:class:`~hpctrain.comm.call.handle.Waitable`)."""
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the request finishes; return its result or raise its error (TimeoutError after
        ``timeout`` s, the request still pending)."""
        if self.owner is not None and not self._event.is_set():
            self.owner.blocked(1)
            try:
                finished = self._event.wait(timeout)
            finally:
                self.owner.blocked(-1)
        else:
            finished = self._event.wait(timeout)
        if not finished:
            raise TimeoutError(f"request {self.name} did not finish within {timeout} s (it is still pending: "
                               "wait again)")
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self, value: Any = None, error: Optional[BaseException] = None) -> None:
        self._value, self._error = value, error
        self._event.set()


class Request:
    """One started collective: what the ranks compare (``sig``) and what this rank runs (``payload``).

    ``labels``: the timeline's rows for it, as ``(row, kind)`` (default: one row, its name and kind).
    """

    __slots__ = ("name", "kind", "ps", "sig", "payload", "handle", "labels", "started")

    def __init__(self, name: str, kind: str, ps: int, sig: tuple, payload: Any, labels: tuple = (), owner=None):
        self.name, self.kind, self.ps, self.sig, self.payload = name, kind, ps, sig, payload
        self.handle = OpHandle(name, owner)
        self.labels = labels or ((name, kind),)
        self.started = time.time()      # when this rank started it (its own clock)


class Entry:
    """A name in the shared table: who started it, with which signature, since when (rank 0's clock), in
    which cycle each rank's request arrived (``arrived``: rank -> that cycle's time), and when the first
    rank started it (``first``: that rank's clock, finer than a cycle)."""

    __slots__ = ("kind", "ps", "sigs", "since", "warned", "arrived", "first")

    def __init__(self, kind: str, ps: int, since: float):
        self.kind, self.ps, self.sigs, self.since, self.warned = kind, ps, {}, since, False
        self.arrived = {}
        self.first = float("inf")
