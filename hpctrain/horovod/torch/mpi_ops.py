"""Horovod's torch collectives (``hvd.allreduce`` and friends) on hpctrain's negotiated core.

Every op has Horovod's forms: ``op(...)`` (differentiable where Horovod's
is, see :mod:`hpctrain.horovod.torch.autograd`), ``op_async(...)`` returning
an integer handle for :func:`poll`/:func:`synchronize`, and for the
element-wise ones the in-place ``op_(...)``/``op_async_(...)``.  Tensors are
read through zero-copy numpy views (CUDA tensors through one host copy each
way); do not modify a tensor until its handle is synchronized.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch

from ...tensors import to_numpy
from .. import basics, requests
from ..basics import global_process_set
from ..requests import set_size

__all__ = ["allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
           "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
           "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast",
           "broadcast_async", "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
           "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "join", "barrier",
           "poll", "synchronize"]

_lock = threading.Lock()
_handles: Dict[int, Tuple[Any, Callable[[Any], Any]]] = {}
_next = [0]


def _register(op, finish: Callable[[Any], Any]) -> int:
    with _lock:
        _next[0] += 1
        _handles[_next[0]] = (op, finish)
        return _next[0]


def poll(handle: int) -> bool:
    """Return whether the op of ``handle`` has finished (then :func:`synchronize` will not block)."""
    with _lock:
        if handle not in _handles:
            raise ValueError(f"unknown or already synchronized handle {handle!r}")
        return _handles[handle][0].done()


def synchronize(handle: int) -> Any:
    """Wait for the op of ``handle`` and return its output tensor(s); the handle is then spent."""
    with _lock:
        if handle not in _handles:
            raise ValueError(f"unknown or already synchronized handle {handle!r}")
        op, finish = _handles.pop(handle)
    return finish(op.wait())


def _numpy(tensor: torch.Tensor):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    return to_numpy(tensor)


def _into(tensor: torch.Tensor, restore) -> Callable[[np.ndarray], torch.Tensor]:
    def finish(result: np.ndarray) -> torch.Tensor:
        with torch.no_grad():
            tensor.copy_(restore(result).view(tensor.shape))
        return tensor
    return finish


# -- allreduce -----------------------------------------------------------------------
def _allreduce_request(tensor, name, op, prescale_factor, postscale_factor, process_set):
    arr, restore = _numpy(tensor)
    return requests.allreduce(arr, name, op, prescale_factor, postscale_factor, process_set), restore


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start an allreduce of ``tensor`` (default op Average); return a handle for :func:`synchronize`."""
    op_, restore = _allreduce_request(tensor, name, basics.op_name(op, average), prescale_factor,
                                      postscale_factor, process_set)
    return _register(op_, restore)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start an in-place allreduce: :func:`synchronize` writes the result into ``tensor``."""
    op_, restore = _allreduce_request(tensor, name, basics.op_name(op, average), prescale_factor,
                                      postscale_factor, process_set)
    return _register(op_, _into(tensor, restore))


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Return the reduction of ``tensor`` over the ranks of ``process_set`` (default op Average).

    Differentiable: the gradient is the same reduction of the output's gradient.
    ``compression`` (``hvd.Compression.fp16`` or an hpctrain compressor name
    wrapper) compresses the tensor for the trip.
    """
    from .autograd import HorovodAllreduce
    from .compression import Compression
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    out = HorovodAllreduce.apply(compressed, basics.op_name(op, average), name, float(prescale_factor),
                                 float(postscale_factor), process_set)
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                        process_set))


def _grouped_request(tensors, name, op, prescale_factor, postscale_factor, process_set):
    converted = [_numpy(t) for t in tensors]
    handle = requests.grouped_allreduce([a for a, _ in converted], name, op, prescale_factor, postscale_factor,
                                        process_set)
    return handle, [r for _, r in converted]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start one fused allreduce of the list ``tensors``; :func:`synchronize` returns the list of results."""
    op_, restores = _grouped_request(tensors, name, basics.op_name(op, average), prescale_factor,
                                     postscale_factor, process_set)
    return _register(op_, lambda outs: [r(o) for r, o in zip(restores, outs)])


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """Start a fused in-place allreduce of ``tensors``."""
    tensors = list(tensors)
    op_, restores = _grouped_request(tensors, name, basics.op_name(op, average), prescale_factor,
                                     postscale_factor, process_set)
    return _register(op_, lambda outs: [_into(t, r)(o) for t, r, o in zip(tensors, restores, outs)])


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """Return the reductions of ``tensors``, fused into one request (differentiable)."""
    from .autograd import HorovodGroupedAllreduce
    from .compression import Compression
    compression = compression or Compression.none
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(basics.op_name(op, average), name, float(prescale_factor),
                                         float(postscale_factor), process_set, *[p[0] for p in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> List[torch.Tensor]:
    """Reduce each of ``tensors`` in place (one fused request) and return them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def sparse_allreduce_async(tensor, name=None, op=None, process_set=global_process_set) -> Callable[[], Any]:
    """Start reducing a sparse COO tensor by gathering every rank's indices and values.

    Returns a function that waits and returns the sparse result (values
    divided by the ranks for Average), as Horovod's does.
    """
    op = basics.op_name(op)
    if op not in ("avg", "sum"):
        raise ValueError("sparse_allreduce_async supports op Average or Sum")
    t = tensor.coalesce()
    indices = t.indices().t().contiguous()
    h_idx = allgather_async(indices, name=None if name is None else f"{name}.indices", process_set=process_set)
    h_val = allgather_async(t.values().contiguous(), name=None if name is None else f"{name}.values",
                            process_set=process_set)

    def wait():
        idx, val = synchronize(h_idx), synchronize(h_val)
        if op == "avg":
            val = val / set_size(process_set)
        return torch.sparse_coo_tensor(idx.t(), val, size=tensor.shape)
    return wait


# -- data-moving collectives ---------------------------------------------------------------
def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start gathering every rank's ``tensor`` along dim 0 (dim 0 may differ per rank)."""
    arr, restore = _numpy(tensor)
    return _register(requests.allgather(arr, name, process_set), restore)


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return the concatenation along dim 0 of every rank's ``tensor`` (differentiable)."""
    from .autograd import HorovodAllgather
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start gathering each of ``tensors`` (one request); :func:`synchronize` returns the list."""
    converted = [_numpy(t) for t in tensors]
    op_ = requests.grouped_allgather([a for a, _ in converted], name, process_set)
    return _register(op_, lambda outs: [r(o) for (_, r), o in zip(converted, outs)])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[torch.Tensor]:
    """Return the allgather of each of ``tensors`` (differentiable)."""
    from .autograd import HorovodGroupedAllgather
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def _broadcast_request(tensor, root_rank, name, process_set):
    arr, restore = _numpy(tensor)
    return requests.broadcast(arr, root_rank, name, process_set), restore


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start broadcasting ``root_rank``'s ``tensor``; :func:`synchronize` returns a new tensor."""
    op_, restore = _broadcast_request(tensor, root_rank, name, process_set)
    return _register(op_, restore)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start an in-place broadcast into ``tensor``."""
    op_, restore = _broadcast_request(tensor, root_rank, name, process_set)
    return _register(op_, _into(tensor, restore))


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank (differentiable)."""
    from .autograd import HorovodBroadcast
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall: rows ``splits[i]`` go to rank i; :func:`synchronize` returns (output, received splits)."""
    arr, restore = _numpy(tensor)
    problem = ""
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            problem = f"alltoall splits must be an int32 tensor, got {splits.dtype}"
        splits = splits.cpu().numpy().ravel()
    op_ = requests.alltoall(arr, splits, name, process_set, problem)
    return _register(op_, lambda out: (restore(out[0]), torch.from_numpy(np.asarray(out[1], dtype=np.int32))))


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Return ``(received rows, received splits)``, or only the rows without ``splits`` (dim 0 then split
    evenly); differentiable."""
    from .autograd import HorovodAlltoall
    out, received = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def reducescatter_async(tensor, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                        process_set=global_process_set) -> int:
    """Start a reduce-scatter (default op Average): this rank gets its block of dim 0 of the reduction."""
    arr, restore = _numpy(tensor)
    op_ = requests.reducescatter(arr, name, basics.op_name(op), prescale_factor, postscale_factor, process_set)
    return _register(op_, restore)


def reducescatter(tensor, name=None, compression=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=global_process_set) -> torch.Tensor:
    """Return this rank's block of the reduction of ``tensor`` (the first ``dim0 % n`` ranks get a row more)."""
    from .autograd import HorovodReducescatter
    from .compression import Compression
    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, basics.op_name(op), float(prescale_factor),
                                     float(postscale_factor), process_set)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                                process_set=global_process_set) -> int:
    """Start the reduce-scatter of each of ``tensors`` (one request)."""
    converted = [_numpy(t) for t in tensors]
    op_ = requests.grouped_reducescatter([a for a, _ in converted], name, basics.op_name(op), prescale_factor,
                                         postscale_factor, process_set)
    return _register(op_, lambda outs: [r(o) for (_, r), o in zip(converted, outs)])


def grouped_reducescatter(tensors, name=None, compression=None, op=None, prescale_factor=1.0,
                          postscale_factor=1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """Return the reduce-scatter of each of ``tensors`` (differentiable)."""
    from .autograd import HorovodGroupedReducescatter
    return list(HorovodGroupedReducescatter.apply(name, basics.op_name(op), float(prescale_factor),
                                                  float(postscale_factor), process_set, *tensors))


# -- synchronisation ---------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Wait until every rank has joined; meanwhile take part in the others' allreduces with zeros.

    Returns the rank that joined last (the same on every rank).  Allgather,
    broadcast and the other ops fail on the ranks still running while any
    rank has joined.  ``device`` is accepted for Horovod compatibility.
    """
    return basics.controller().join().wait()


def barrier(process_set=global_process_set) -> None:
    """Return when every rank of ``process_set`` has entered the barrier."""
    requests.barrier(process_set)

