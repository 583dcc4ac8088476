"""Make replicas equal (parameters, optimizer state) and average values across ranks."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Tuple, Union

import torch

from ..agreement import check_same
from ..metrics import average_metrics
from ..world import comm_or_world
from .flat import flatten, unflatten_into

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "named_tensors", "allreduce", "average_metrics"]


def broadcast_tensors(tensors: List[torch.Tensor], root: int, comm) -> None:
    """Overwrite every tensor in place with ``root``'s values: one broadcast per dtype.

    Tensors may live on any device (CUDA ones are staged through host memory).
    Cost: one copy into a flat host buffer per dtype, one broadcast of the
    total bytes, one copy back.
    """
    groups: Dict[torch.dtype, List[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    for dtype, ts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        flat = flatten(ts)
        wire = flat.view(torch.uint8) if dtype == torch.bool else flat
        got = comm.broadcast(wire, root=root)
        unflatten_into(got.view(torch.bool) if dtype == torch.bool else got, ts)


def broadcast_parameters(params: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]],
                                      Iterable[torch.Tensor]],
                         root: int = 0, comm=None) -> None:
    """Copy ``root``'s parameters (and buffers) into every rank's, in place.

    Args:
        params: ``model.state_dict()`` (parameters and buffers),
            ``model.named_parameters()`` (or a list of ``(name, tensor)``
            pairs), or ``model.parameters()`` (tensors, matched by position);
            the same on every rank.
        root: the rank whose values win.
        comm: the communicator (default: the world).

    Raises TypeError for anything else, saying what to pass, and ValueError
    on every rank, naming the ranks, if the names, shapes or dtypes differ
    between ranks.
    """
    comm = comm_or_world(comm)
    items = sorted(named_tensors(params), key=lambda kv: kv[0])
    check_same(comm, "the tensors to broadcast (name, shape, dtype)",
               [(n, tuple(t.shape), str(t.dtype)) for n, t in items], f"{len(items)} tensors")
    broadcast_tensors([t for _, t in items], root, comm)


def named_tensors(params) -> List[Tuple[str, torch.Tensor]]:
    """Return ``params`` (a state dict, named pairs or bare tensors) as ``(name, tensor)`` pairs.

    Bare tensors are named by position (``"00000"``, ...) so that sorting by
    name keeps their order.
    """
    what = ("broadcast_parameters takes model.state_dict(), model.named_parameters() or model.parameters() "
            "(or a list of (name, tensor) pairs)")
    if isinstance(params, torch.Tensor) or isinstance(params, (str, bytes)) or not hasattr(params, "__iter__"):
        raise TypeError(f"{what}; got a {type(params).__name__}")
    items = list(params.items()) if isinstance(params, Mapping) else list(params)
    if all(isinstance(t, torch.Tensor) for t in items):
        return [(f"{i:05d}", t) for i, t in enumerate(items)]
    if all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[1], torch.Tensor) for kv in items):
        return items
    bad = next(x for x in items if not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor)))
    raise TypeError(f"{what}; got an element of type {type(bad).__name__}: mixed or non-tensor entries")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0, comm=None) -> None:
    """Copy ``root``'s optimizer state (moments, step counts, hyper-parameters) to every rank.

    Works when the other ranks have no state yet (a fresh optimizer): the
    structure travels as a small object, the tensors by one broadcast per dtype.
    """
    comm = comm_or_world(comm)
    if getattr(optimizer, "hpctrain_state_spans_ranks", False):    # (a ShardedOptimizer: gathered on root)
        optimizer.consolidate_state_dict(to=root)
    sd = optimizer.state_dict() if comm.rank == root else None
    tensors: List[torch.Tensor] = []
    skeleton = _strip(sd, tensors) if sd is not None else None
    skeleton = comm.broadcast_object(skeleton, root=root)
    if comm.rank != root:
        tensors = []
        sd = _fill(skeleton, tensors)
    broadcast_tensors(tensors, root, comm)
    if comm.rank != root:
        optimizer.load_state_dict(sd)


def _strip(obj: Any, out: List[torch.Tensor]) -> Any:
    """Replace each tensor in a nested structure by a placeholder; collect the tensors in order."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return ("__tensor__", tuple(obj.shape), str(obj.dtype).replace("torch.", ""))
    if isinstance(obj, dict):
        return {k: _strip(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, out) for v in obj)
    return obj


def _fill(obj: Any, out: List[torch.Tensor]) -> Any:
    """Inverse of :func:`_strip`: allocate a tensor for each placeholder, in the same order."""
    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "__tensor__":
        t = torch.empty(obj[1], dtype=getattr(torch, obj[2]))
        out.append(t)
        return t
    if isinstance(obj, dict):
        return {k: _fill(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, out) for v in obj)
    return obj


def allreduce(tensor: torch.Tensor, op: str = "sum", comm=None) -> torch.Tensor:
    """Return ``tensor`` reduced over ranks (default: summed, as every collective); see :meth:`Communicator.allreduce`."""
    return comm_or_world(comm).allreduce(tensor, op=op)
