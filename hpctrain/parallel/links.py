"""Messages between neighbouring pipeline stages, with shapes exchanged once.

Both pipelines (PyTorch and Keras) send activations forward and their
gradients backward through a :class:`StageLinks` on the pipeline
communicator.  The first message in each direction of each link carries its
dtype and shape (``send_async`` with a header); every later one is the bytes
alone, one MPI message with nothing to parse, and the receiver rebuilds
``(k, *row_shape)`` from the length: ``k = nbytes / (itemsize * prod(row_shape))``.
So micro-batches of different sizes (a remainder, a short last batch) need
no new exchange, while a change of row shape or dtype after the first step is
refused by the sender with an error naming the stage.

Both sides agree on which message is "first" because every schedule runs the
forwards, and the backwards, of micro-batches in increasing order on every
stage: the k-th message sent on a link is the k-th received.

A stage that fails sends a *failure message* (a marker and the error text) in
place of every message it still owes, so its neighbours raise
:class:`PipelineError` instead of waiting forever, and pass it on.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

__all__ = ["PipelineError", "StageLinks"]

_ERROR = b"\x00HPCTRAIN-PIPELINE-ERROR\x00"


class PipelineError(RuntimeError):
    """A stage of the pipeline failed; raised on every rank of the pipeline."""


class StageLinks:
    """This stage's links to the previous and next stage on the pipeline communicator ``comm``.

    ``kind`` is ``"F"`` (activations, forward) or ``"B"`` (their gradients,
    backward); a link is (peer, kind).  Cost per message after the first: one
    send of the payload's bytes.
    """

    def __init__(self, comm, stage: int):
        self.comm, self.stage = comm, stage
        self._sent: Dict[Tuple[int, str], Tuple[np.dtype, tuple]] = {}
        self._received: Dict[Tuple[int, str], Tuple[np.dtype, tuple, int]] = {}    # ... and bytes per row

    def send_async(self, arr: np.ndarray, dest: int, tag: int, kind: str, copy: bool = True):
        """Start sending ``arr`` to stage ``dest``; with its header only the first time on this link.

        ``copy=False``: sent from ``arr``'s memory, which must stay unchanged
        until the returned handle completes (see ``Communicator.send_async``).
        """
        key, layout = (dest, kind), (arr.dtype, tuple(arr.shape[1:]))
        known = self._sent.get(key)
        if known is None:
            self._sent[key] = layout
            return self.comm.send_async(arr, dest, tag=tag, copy=copy)
        if known != layout:
            raise ValueError(f"stage {self.stage}: a {_what(kind)} of rows {layout[1]} {layout[0]} for stage {dest}, "
                             f"but the first step sent rows {known[1]} {known[0]}; shapes are exchanged once, "
                             f"so only the first dimension may change (build a new Pipeline for new shapes)")
        return self.comm.send_async(arr, dest, tag=tag, header=False, copy=copy)

    def recv(self, source: int, tag: int, kind: str) -> np.ndarray:
        """Receive from stage ``source``; raise :class:`PipelineError` if it sent a failure message."""
        key = (source, kind)
        known = self._received.get(key)
        if known is None:
            arr = self.comm.recv(source, tag=tag)
            if not _failure(arr.reshape(-1).view(np.uint8) if arr.dtype == np.uint8 else None):
                rows = tuple(arr.shape[1:])
                self._received[key] = (arr.dtype, rows, arr.dtype.itemsize * int(np.prod(rows)))
            return arr
        raw = self.comm.recv_bytes(source, tag=tag)
        _failure(raw)
        dtype, rows, row_bytes = known
        if row_bytes == 0 or raw.size % row_bytes:
            raise PipelineError(f"stage {self.stage}: {raw.size} bytes from stage {source} are not whole rows of "
                                f"{rows} {dtype} ({row_bytes} bytes each)")
        return raw.view(dtype).reshape((-1,) + rows)

    def fail(self, dest: int, tag: int, kind: str, message: str):
        """Start sending a failure message in place of the message owed to ``dest`` on this link."""
        payload = np.frombuffer(_ERROR + message.encode(), dtype=np.uint8)
        return self.comm.send_async(payload, dest, tag=tag, header=(dest, kind) not in self._sent)

    def fail_remaining(self, actions, stages: int, message: str) -> None:
        """Send ``message`` in place of every message the schedule ``actions`` still owe the neighbours; wait."""
        handles = []
        for a in actions:
            if a.kind == "F" and self.stage < stages - 1:
                handles.append(self.fail(self.stage + 1, 2 * a.micro, "F", message))
            if a.kind == "B" and self.stage > 0:
                handles.append(self.fail(self.stage - 1, 2 * a.micro + 1, "B", message))
        for h in handles:
            h.wait()


def _what(kind: str) -> str:
    return "activation" if kind == "F" else "activation gradient"


def _failure(raw) -> bool:
    """Raise :class:`PipelineError` if the bytes ``raw`` are a failure message (returns False otherwise)."""
    if raw is not None and raw.size >= len(_ERROR) and raw[:len(_ERROR)].tobytes() == _ERROR:
        raise PipelineError(raw[len(_ERROR):].tobytes().decode(errors="replace"))
    return False
