"""Point-to-point messages of a communicator: send and receive, blocking and not, with or without a header.

A mixin of :class:`hpctrain.comm.base.Communicator`: it converts the
message with :mod:`hpctrain.tensors` and hands it to the backend's byte
primitives (``_isend``, ``_recv``, ``_isend_bytes``, ``_recv_bytes``);
receives run in the runtime's receive lane, so a receive never waits behind
a collective.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..tensors import to_numpy
from .handle import Handle, same as _same

__all__ = ["PointToPoint"]


class PointToPoint:
    """send / recv of one communicator (uses its ``_rt``, ``_size``, ``name`` and ``_check_rank``)."""

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
            return self._isend(arr, int(dest), int(tag))
        return self._isend_bytes(arr.reshape(-1).view(np.uint8), int(dest), int(tag))

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
        return (lambda: self._recv(int(source), int(tag))), f"recv from rank {source} (tag {tag}) on {self.name}"

    def recv_bytes(self, source: int, tag: int = 0) -> np.ndarray:
        """Receive a message sent with ``send_async(..., header=False)``: its bytes, as a flat uint8 array."""
        self._check_rank(source, "source")
        text = f"recv of bytes from rank {source} (tag {tag}) on {self.name}"
        return self._rt.receives.run(lambda: self._recv_bytes(int(source), int(tag)), text)
