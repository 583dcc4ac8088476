"""Point-to-point messages of a communicator: send and receive, blocking and not, with or without a header.

A part of :class:`hpctrain.comm.base.Communicator`, whose ``send``, ``recv``,
... call this object's: it converts the message with :mod:`hpctrain.tensors`
and hands it to the backend's byte primitives (``isend``, ``recv``,
``isend_bytes``, ``recv_bytes``);
receives run in the runtime's receive lane, so a receive never waits behind
a collective.

:meth:`PointToPoint.recv_any` is what a server loop lives on: the next
message from any rank (or one rank) with any tag (or one tag), waited for
without spinning, optionally ``idle`` (the stall watchdog leaves a server
that waits for work alone), and raising :class:`~hpctrain.errors.RanksFailedError`
when a rank it could hear from has failed (under MPI's fault-tolerance
extension), after which receives from the others go on.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from ...tensors import to_numpy
from ..call.handle import Handle, same as _same

__all__ = ["ANY", "Message", "PointToPoint"]

ANY = -1            # any source, any tag (MPI_ANY_SOURCE, MPI_ANY_TAG)
_NAP_FIRST_S, _NAP_MAX_S = 20e-6, 1e-3      # the waits of recv_any: 20 us, doubling up to 1 ms


class Message(NamedTuple):
    """A message taken by :meth:`PointToPoint.recv_any`: who sent it, its tag, its bytes (flat uint8)."""

    source: int
    tag: int
    data: np.ndarray


class PointToPoint:
    """send / recv of the communicator ``comm`` (over its backend, in its runtime's receive lane)."""

    def __init__(self, comm):
        self._rt, self._backend, self._size, self.name = comm._rt, comm._backend, comm._size, comm.name
        self._check_rank = comm._calls.check_rank

    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dest`` (its shape and dtype travel with it); return when it may be reused."""
        self.send_async(x, dest, tag).wait()

    def send_async(self, x: Any, dest: int, tag: int = 0, header: bool = True, copy: bool = True) -> Handle:
        """Start sending ``x`` (a copy, unless ``copy=False``) to ``dest``; return a :class:`Handle` (like MPI_Isend).

        With ``header=False`` only the bytes travel (one message, no dtype or
        shape): the receiver takes them with :meth:`recv_bytes` and must know
        what they are.  For repeated messages of a known layout (pipeline
        activations); cost is one message of ``x.nbytes`` instead of two.

        With ``copy=False`` a CPU array or tensor is sent from its own memory
        (no copy of ``x.nbytes``): the caller must not modify it until the
        handle's ``wait()`` returns; the handle keeps it alive.  (A one-rank
        communicator copies anyway: its message is the array it delivers.)
        """
        arr, _ = to_numpy(x)
        self._check_rank(dest, "dest")
        if copy or self._size == 1:
            arr = np.array(arr, copy=True, order="C")
        if header:
            return self._backend.isend(arr, int(dest), int(tag))
        return self._backend.isend_bytes(arr.reshape(-1).view(np.uint8), int(dest), int(tag))

    def recv(self, source: int, tag: int = 0, like: Any = None) -> Any:
        """Receive what rank ``source`` sent with ``tag``; a numpy array, or ``like``'s type if given.

        Runs on the caller's thread, after the receives started before it with
        :meth:`recv_async`: no hand-off to the receive thread (two thread
        switches a message saved).
        """
        restore = to_numpy(like)[1] if like is not None else _same
        return restore(self._rt.receives.run(*self._recv_call(source, tag)))

    def recv_async(self, source: int, tag: int = 0, like: Any = None) -> Handle:
        """Start :meth:`recv` and return a :class:`Handle`; receives complete in the order they were posted."""
        restore = to_numpy(like)[1] if like is not None else _same
        return Handle(self._rt.receives.submit(*self._recv_call(source, tag)), restore)

    def _recv_call(self, source: int, tag: int):
        """The receive of (``source``, ``tag``) as the receive lane takes it: ``(call, text for the watchdog)``."""
        self._check_rank(source, "source")
        return (lambda: self._backend.recv(int(source), int(tag))), f"recv from rank {source} (tag {tag}) on {self.name}"

    def recv_bytes(self, source: int, tag: int = 0) -> np.ndarray:
        """Receive a message sent with ``send_async(..., header=False)``: its bytes, as a flat uint8 array."""
        self._check_rank(source, "source")
        text = f"recv of bytes from rank {source} (tag {tag}) on {self.name}"
        return self._rt.receives.run(lambda: self._backend.recv_bytes(int(source), int(tag)), text)

    def probe(self, source: int = ANY, tag: int = ANY) -> Optional[Tuple[int, int]]:
        """``(source, tag)`` of a message that has arrived and matches, without taking it; None if none has.

        ``ANY`` matches every rank or tag.  One local call (MPI_Iprobe).
        Raises :class:`~hpctrain.errors.RanksFailedError` as :meth:`recv_any` does.
        """
        if source != ANY:
            self._check_rank(source, "source")
        found = self._backend.iprobe(int(source), int(tag))
        return None if found is None else (found[0], found[1])

    def recv_any(self, source: int = ANY, tag: int = ANY, idle: bool = False,
                 timeout: Optional[float] = None) -> Optional[Message]:
        """Take the next message (sent with ``send_async(..., header=False)``) from ``source`` with ``tag``.

        ``ANY`` matches every rank or tag; messages of one sender and tag come
        in the order sent.  The wait polls (MPI_Iprobe) and sleeps between
        polls, 20 us doubling up to 1 ms, so a waiting process leaves its core
        to the others (a blocking MPI receive busy-polls one): at most about
        1 ms of latency added to a message that arrives after a long wait,
        none to one already there.  ``idle=True``: waiting is this process's
        job (a server between requests), so the stall watchdog does not warn
        or abort however long it waits.  ``timeout`` (seconds): return None
        when nothing came by then.

        Raises :class:`~hpctrain.errors.RanksFailedError` (with the failed
        world ranks) when a rank that could send has failed; the failure is
        acknowledged first, so the next call receives from the others (MPI's
        fault-tolerance extension, ``hpctrain launch --elastic``; without it
        the job ends on a failure instead).
        """
        if source != ANY:
            self._check_rank(source, "source")
        source, tag = int(source), int(tag)
        who = "any rank" if source == ANY else f"rank {source}"
        text = f"recv from {who} ({'any tag' if tag == ANY else f'tag {tag}'}) on {self.name}"
        return self._rt.receives.run(lambda: self._poll_recv(source, tag, timeout), text, watched=not idle)

    def _poll_recv(self, source: int, tag: int, timeout: Optional[float]) -> Optional[Message]:
        nap, deadline = _NAP_FIRST_S, None if timeout is None else time.monotonic() + timeout
        while True:
            found = self._backend.iprobe(source, tag)
            if found is not None:
                src, tg = found[0], found[1]
                return Message(src, tg, self._backend.recv_found(src, tg))
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(nap)
            nap = min(2 * nap, _NAP_MAX_S)
