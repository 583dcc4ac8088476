"""What each negotiated Horovod request does once every rank has started it.

:mod:`hpctrain.horovod.controller` decides *when* requests run; this module
groups the ready ones (allreduces that can share one ``grouped_allreduce``)
and runs them on the process set's hpctrain communicator, on numpy buffers.
Signatures (``sig``) are plain tuples that every rank sends for comparison:
``(kind, process set, details)``, where details end with ``("invalid", text)``
when an argument was bad on that rank.

Horovod's numeric conventions kept here:

* ``prescale_factor``/``postscale_factor`` multiply before/after the
  reduction in float64 for integer tensors, float32 for float16 and the
  tensor's own dtype otherwise, then cast back (so integers truncate);
* ``op=Average`` on integers is the sum divided by the ranks, truncated
  toward zero; a rank that has joined contributes zeros but still counts;
* ``Adasum`` runs :func:`hpctrain.collectives.adasum.adasum_allreduce`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..collectives.adasum import adasum_allreduce
from ..errors import format_ranks
from ..errors import CollectiveMismatchError, HpctrainError, InvalidCollectiveError

__all__ = ["Group", "plan", "invalid", "describe", "verdict", "reduce_arrays", "scale"]

FUSABLE_OPS = ("sum", "avg", "min", "max", "prod")


def invalid(sig: tuple) -> str:
    """Return the invalid-argument text carried by ``sig`` ("" when valid)."""
    details = sig[2]
    if isinstance(details, tuple) and len(details) == 2 and details[0] == "invalid":
        return details[1]
    return ""


def describe(sig: tuple) -> str:
    """Return one rank's request as text for error messages."""
    kind, ps, details = sig
    where = "" if ps == 0 else f" on process set {ps}"
    bad = invalid(sig)
    if bad:
        return f"{kind}{where}: {bad}"
    return f"{kind}{where} {_details(kind, details)}"


def verdict(name: str, entry, joined: List[int], sets) -> Optional[HpctrainError]:
    """Return None when the ranks' signatures agree and the joined ranks can take part, else the error."""
    sigs = entry.sigs
    first = next(iter(sigs.values()))
    if entry.ps not in sets:
        return CollectiveMismatchError(f"{entry.kind} {name!r}: process set {entry.ps} was removed while "
                                       f"it was in flight")
    if joined and entry.kind not in ("allreduce", "grouped_allreduce"):
        return CollectiveMismatchError(f"{entry.kind} {name!r} cannot run while {format_ranks(joined)} "
                                       f"{'has' if len(joined) == 1 else 'have'} joined (hvd.join()); "
                                       f"only allreduce can")
    if all(s == first for s in sigs.values()):
        why = invalid(first)
        return InvalidCollectiveError(f"{entry.kind} {name!r}: {why} (the same on every rank)") if why else None
    groups: Dict[Any, List[int]] = {}
    for r, s in sorted(sigs.items()):
        groups.setdefault(s, []).append(r)
    lines = "\n".join(f"  {format_ranks(ranks)}: {describe(s)}" for s, ranks in groups.items())
    return CollectiveMismatchError(f"ranks disagree on {entry.kind} {name!r}:\n{lines}")


def _details(kind: str, d: tuple) -> str:
    if kind in ("allreduce", "reducescatter"):
        dtype, shape, op, pre, post = d
        scales = "" if pre == post == 1.0 else f", prescale {pre}, postscale {post}"
        return f"{dtype} {tuple(shape)} op={op}{scales}"
    if kind in ("allgather", "alltoall"):
        return f"{d[0]} (*, {', '.join(map(str, d[1]))})" if d[1] else f"{d[0]} (*,)"
    if kind == "broadcast":
        return f"{d[0]} {tuple(d[1])} root={d[2]}"
    if kind == "broadcast_object":
        return f"root={d[0]}"
    return repr(d)


class Group:
    """Ready requests that run together: one fused allreduce, or one request of any other kind."""

    def __init__(self, kind: str, names: List[str], sigs: List[tuple], members: Tuple[int, ...], comm,
                 error: Optional[BaseException] = None, entries: Optional[list] = None):
        self.kind, self.names, self.sigs, self.members, self.comm, self.error = kind, names, sigs, members, comm, error
        self.entries = entries or []          # the table entries of ``names`` (when each rank started them)

    def run(self, mine: Sequence[Optional[Any]], controller) -> List[Any]:
        """Run on this rank (``mine[i]`` is this rank's request for ``names[i]``, None if it joined)."""
        return _RUNNERS[self.kind](self, mine, controller)


def plan(ready: List[Tuple[str, Any, Optional[BaseException]]], mine: Dict[str, Any], sets) -> List[Group]:
    """Turn the ready ``(name, entry, error or None)`` list into groups, in the order every rank shares."""
    groups: List[Group] = []
    fused: Dict[tuple, Group] = {}
    for name, entry, error in ready:
        sig = next(iter(entry.sigs.values()))
        members, comm = sets.get(entry.ps, ((), None))
        if error is not None:
            groups.append(Group(entry.kind, [name], [sig], members, comm, error, [entry]))
            continue
        key = None
        if entry.kind == "allreduce" and sig[2][2] in FUSABLE_OPS:
            dtype, _, op, pre, post = sig[2]
            key = (entry.ps, dtype, op, pre, post)
        if key is not None and key in fused:
            fused[key].names.append(name)
            fused[key].sigs.append(sig)
            fused[key].entries.append(entry)
            continue
        group = Group(entry.kind, [name], [sig], members, comm, entries=[entry])
        groups.append(group)
        if key is not None:
            fused[key] = group
    return groups


# -- numeric helpers -----------------------------------------------------------------
def scale(arr: np.ndarray, factor: float) -> np.ndarray:
    """Return ``arr * factor`` computed as Horovod does (float64 for integers, float32 for float16), cast back."""
    if factor == 1.0:
        return arr
    kind = arr.dtype.kind
    work = np.float64 if kind in "iub" else np.float32 if arr.dtype == np.float16 else arr.dtype
    return (arr.astype(work, copy=False) * np.asarray(factor, dtype=work)).astype(arr.dtype, copy=False)


def _int_average(total: np.ndarray, n: int) -> np.ndarray:
    """The sum ``total`` divided by ``n``, truncated toward zero (integer dtypes)."""
    q = np.abs(total) // n
    return np.where(total < 0, -q, q).astype(total.dtype, copy=False)


def reduce_arrays(comm, arrays: List[np.ndarray], op: str, pre: float, post: float) -> List[np.ndarray]:
    """All-reduce ``arrays`` (same dtype) over ``comm`` with Horovod's op and scale conventions."""
    arrays = [scale(a, pre) for a in arrays]
    integer = arrays[0].dtype.kind in "iu"
    if op == "adasum":
        out = [adasum_allreduce(comm, a) for a in arrays]
    else:
        hop = "sum" if (op == "avg" and integer) else op
        out = comm.grouped_allreduce(arrays, op=hop) if len(arrays) > 1 else [comm.allreduce(arrays[0], op=hop)]
        if op == "avg" and integer:
            out = [_int_average(o, comm.size) for o in out]
    return [scale(o, post) for o in out]


def _zeros(sig: tuple) -> np.ndarray:
    dtype, shape = sig[2][0], sig[2][1]
    return np.zeros(shape, dtype=np.dtype(dtype))


# -- runners: (group, this rank's payloads, controller) -> results ------------------------
def _allreduce(g: Group, mine, ctl) -> List[Any]:
    arrays = [r.payload if r is not None else _zeros(s) for r, s in zip(mine, g.sigs)]
    _, _, op, pre, post = g.sigs[0][2]
    return reduce_arrays(g.comm, arrays, op, pre, post)


def _grouped_allreduce(g: Group, mine, ctl) -> List[Any]:
    (req,), (sig,) = mine, g.sigs
    specs, op, pre, post = sig[2]
    arrays = req.payload if req is not None else [np.zeros(s, dtype=np.dtype(d)) for d, s in specs]
    by_dtype: Dict[str, List[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    out: List[Any] = [None] * len(arrays)
    for idx in by_dtype.values():
        for i, r in zip(idx, reduce_arrays(g.comm, [arrays[i] for i in idx], op, pre, post)):
            out[i] = r
    return [out]


def _allgather(g: Group, mine, ctl) -> List[Any]:
    return [g.comm.allgather(mine[0].payload)]


def _grouped_allgather(g: Group, mine, ctl) -> List[Any]:
    return [[g.comm.allgather(a) for a in mine[0].payload]]


def _broadcast(g: Group, mine, ctl) -> List[Any]:
    return [g.comm.broadcast(mine[0].payload, root=g.sigs[0][2][2])]


def _alltoall(g: Group, mine, ctl) -> List[Any]:
    arr, splits = mine[0].payload
    received = g.comm.alltoall(np.asarray(splits, dtype=np.int32))
    return [(g.comm.alltoall(arr, splits=splits), received)]


def _reducescatter_array(comm, arr: np.ndarray, op: str, pre: float, post: float) -> np.ndarray:
    """This rank's block of the reduction of ``arr``, with Horovod's scale and integer-average conventions."""
    integer = arr.dtype.kind in "iu"
    out = comm.reduce_scatter(scale(arr, pre), op="sum" if (op == "avg" and integer) else op)
    if op == "avg" and integer:
        out = _int_average(out, comm.size)
    return scale(out, post)


def _reducescatter(g: Group, mine, ctl) -> List[Any]:
    _, _, op, pre, post = g.sigs[0][2]
    return [_reducescatter_array(g.comm, mine[0].payload, op, pre, post)]


def _grouped_reducescatter(g: Group, mine, ctl) -> List[Any]:
    op, pre, post = g.sigs[0][2][1:]
    return [[_reducescatter_array(g.comm, a, op, pre, post) for a in mine[0].payload]]


def _barrier(g: Group, mine, ctl) -> List[Any]:
    g.comm.barrier()
    return [None]


def _broadcast_object(g: Group, mine, ctl) -> List[Any]:
    return [g.comm.broadcast_object(mine[0].payload, root=g.sigs[0][2][0])]


def _allgather_object(g: Group, mine, ctl) -> List[Any]:
    return [g.comm.allgather_object(mine[0].payload)]


def _call(g: Group, mine, ctl) -> List[Any]:
    return [mine[0].payload(g.comm)]


def _add_process_set(g: Group, mine, ctl) -> List[Any]:
    ranks = g.sigs[0][2][0]
    comm = g.comm.split(0 if g.comm.rank in ranks else None, key=g.comm.rank)
    return [ctl.add_set(tuple(ranks), comm)]


def _remove_process_set(g: Group, mine, ctl) -> List[Any]:
    ctl.remove_set(g.sigs[0][2][0])
    return [None]


_RUNNERS = {
    "allreduce": _allreduce, "grouped_allreduce": _grouped_allreduce, "allgather": _allgather,
    "grouped_allgather": _grouped_allgather, "broadcast": _broadcast, "alltoall": _alltoall,
    "reducescatter": _reducescatter, "grouped_reducescatter": _grouped_reducescatter, "barrier": _barrier,
    "broadcast_object": _broadcast_object, "allgather_object": _allgather_object, "call": _call,
    "add_process_set": _add_process_set, "remove_process_set": _remove_process_set,
}
