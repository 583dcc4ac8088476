"""Repeated all-reduces without planning: the path a training loop's small calls take after the first.

A training loop makes the same few calls again and again (same type, dtype,
shape, op, algorithm and in-place flag).  The first call of each goes through
the planning of :mod:`hpctrain.comm.ops.reductions` (conversion, op check,
algorithm choice, the call's description); when that plan can run as one
backend exchange that carries the call check with it, the plan leaves behind a
*repeat* function for the call's key, and later calls with that key run it:

* check what depends on the object, not the key (C-contiguous, writable for
  ``inplace``, a CPU torch tensor that ``Tensor.numpy()`` can view);
* wait for the asynchronous calls issued before, then run in the collective
  lane with the watchdog's record of the call in flight (one record reused,
  nothing formatted unless someone reads it);
* the backend's exchange (:meth:`hpctrain.comm.backends.mpi.MPIBackend.repeat_exchange`:
  on one node, the payload is carried by the call check through the mailbox, summed in
  C), or at one rank nothing (the all-reduce of one rank is its input, as on
  the planned path);
* ``finish`` (divide for ``avg``), and for torch the tensor back.

Anything else (comm log or timeline on, another layout, a tensor the checks
refuse) returns :data:`NOT_REPEATED` and the caller plans the call as usual.  The
result and the call check are those of the planned path: ranks on the repeat
path and ranks planning the same call meet in the same exchange.

Cost per call: a dict lookup on the key, the object checks, the lane's lock
and the exchange; about 1 us of Python beyond the exchange (benchmarks/per_call.py).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from ...collectives.ops import accumulation_dtype, finish
from ...tensors import is_bfloat16
from ..life.lane import InFlight

__all__ = ["NOT_REPEATED", "allreduce_body", "copy_body", "repeat_key", "make_repeat"]

_KEEP_VIEW_BYTES = 1 << 16

NOT_REPEATED = object()     # "plan this call": the repeat path does not apply to this object


def repeat_key(x: Any, *call: Any) -> tuple:
    """Return the key a repeated call is remembered by: the input's type, dtype and shape, then ``call``
    (the collective's name and arguments, e.g. ``("allreduce", op, algorithm, inplace)``)."""
    return (type(x), x.dtype, x.shape) + call


def _numpy_view(kind: str, nbytes: int) -> Optional[Callable[[Any], Any]]:
    """Return how a repeated call gets the numpy view of its input (None for numpy itself), or None if it refuses.

    For torch: a CPU contiguous tensor's ``numpy()`` view.  A loop passes the
    same small tensor again and again, so the view of the last one is kept
    and reused while the tensor's memory stays where it was (``data_ptr``:
    ``t.data = ...`` moves it); only for small tensors (a kept view keeps
    its tensor alive).
    """
    if kind == "numpy":
        return None
    last = [None, 0, None]        # tensor, data_ptr, numpy view
    keep = nbytes <= _KEEP_VIEW_BYTES

    def view(t):
        if t is last[0] and t.data_ptr() == last[1]:
            return last[2]
        if not t.is_cpu or t.is_sparse or not t.is_contiguous():
            return None
        a = (t.detach() if t.requires_grad else t).numpy()
        if keep:
            last[:] = t, t.data_ptr(), a
        return a
    return view


def make_repeat(comm, call, kind: str, arr: np.ndarray, body: Callable[[np.ndarray, int], Any],
              inplace: bool = False) -> Optional[Callable[[Any], Any]]:
    """Return the repeated form of calls like ``call`` (its first planned form), or None where none applies.

    ``kind``: "numpy" or "torch"; ``arr``: the numpy form of the first call's
    input; ``body(a, seq)``: the call's work on the numpy form ``a`` of a
    later input (the backend's one exchange, which checks the call on every
    rank and raises :class:`~hpctrain.errors.CollectiveMismatchError` when the
    calls differ), returning the numpy result.  ``inplace``: the result is in
    the input, which is returned (the input must be writable).
    """
    rt = comm._rt
    if kind not in ("numpy", "torch") or (kind == "torch" and is_bfloat16(arr.dtype)) or rt.policy.reforms:
        return None         # (elastic mode: every call goes through Runtime.run, which turns failures into errors)
    lane = rt.collectives
    lock = lane._exec_lock
    view = _numpy_view(kind, arr.nbytes)
    from_numpy = None
    if kind == "torch":
        import torch
        from_numpy = torch.from_numpy
    record = InFlight(lambda: f"{call.text()} #{comm._seq} on {comm.name}", 0.0, comm.world_ranks)
    monotonic = time.monotonic

    def repeat(x):
        if view is None:
            flags = x.flags
            if not flags.c_contiguous or (inplace and not flags.writeable):
                return NOT_REPEATED
            a = x
        else:
            a = view(x)
            if a is None:
                return NOT_REPEATED
        if rt.owner is not None:
            rt._check_owner()
        if lane._pending:
            lane.wait_pending()
        comm._seq = seq = comm._seq + 1
        lock.acquire()
        try:
            record.start, record.waiting_on, record.warned = monotonic(), "", False
            lane.inflight = record
            out = body(a, seq)
        finally:
            lane.inflight = None
            lock.release()
        if inplace:
            return x
        return out if from_numpy is None else from_numpy(out)
    return repeat


def allreduce_body(comm, arr: np.ndarray, op: str, inplace: bool,
                   exchange: Optional[Callable[[np.ndarray, np.ndarray, int], None]]):
    """Return the repeated all-reduce's body for inputs like ``arr``, or None where none applies.

    ``exchange(x, out, seq)``: the backend's exchange that leaves the reduction
    of ``x`` in ``out`` (may be ``x``); None at one rank (the result is the input).
    """
    dtype, shape, n = arr.dtype, arr.shape, comm._size
    acc = accumulation_dtype(dtype)
    if (n > 1 and exchange is None) or (inplace and acc != dtype):
        return None

    def body(a, seq):
        out = a if inplace else np.empty(shape, dtype=acc)
        if exchange is not None:
            exchange(a, out, seq)
        elif out is not a:
            np.copyto(out, a)
        return finish(out, op, n, dtype)
    return body


def copy_body(arr: np.ndarray, shape: tuple):
    """Return the body of a one-rank reduce-scatter or all-gather: a new array of ``shape``, the input's values."""
    def body(a, seq):
        return a.reshape(shape).copy()
    return body
