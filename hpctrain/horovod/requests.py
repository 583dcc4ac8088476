"""Horovod's collectives as negotiated requests on numpy arrays, for every framework's ops.

``hpctrain.horovod.torch`` and ``hpctrain.horovod.tensorflow`` convert their
tensors to numpy and call these functions; each builds the request's
signature (what all ranks compare: dtype, shape, op, scale factors, root,
splits) and starts it with :func:`hpctrain.horovod.basics.submit`.  A bad
argument does not raise here: it becomes the signature ``("invalid", text)``,
so every rank of the process set hears of it in the same negotiation cycle
and fails together (a rank that raised alone would leave the others waiting).

Every function returns the request's :class:`~hpctrain.horovod.pending.OpHandle`;
``wait()`` gives the numpy result (a list for the grouped forms; for
alltoall the pair ``(rows, received splits)``).  ``op`` is hpctrain's name
(``basics.op_name``).  Cost: one negotiation cycle of latency, then the
collective itself on the process set's communicator.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from . import basics

__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
           "check_splits", "reducescatter", "grouped_reducescatter", "barrier", "broadcast_object",
           "allgather_object", "root_index", "set_size", "set_rank"]


def _invalid(text: str) -> tuple:
    return ("invalid", text)


def allreduce(arr: np.ndarray, name: Optional[str], op: str, pre: float, post: float, process_set):
    """Start reducing ``arr`` over the set with Horovod's scale conventions (:mod:`.execute`)."""
    bad = _invalid("Adasum needs a floating-point tensor") if op == "adasum" and arr.dtype.kind != "f" else None
    details = bad or (arr.dtype.name, arr.shape, op, float(pre), float(post))
    return basics.submit("allreduce", name, process_set, details, arr)


def grouped_allreduce(arrays: Sequence[np.ndarray], name: Optional[str], op: str, pre: float, post: float,
                      process_set):
    """Start reducing each of ``arrays`` in one request (fused per dtype)."""
    arrays = list(arrays)
    if not arrays:
        raise ValueError("grouped_allreduce needs at least one tensor")
    specs = tuple((a.dtype.name, a.shape) for a in arrays)
    bad = op == "adasum" and any(a.dtype.kind != "f" for a in arrays)
    details = _invalid("Adasum needs floating-point tensors") if bad else (specs, op, float(pre), float(post))
    return basics.submit("grouped_allreduce", name, process_set, details, arrays)


def allgather(arr: np.ndarray, name: Optional[str], process_set):
    """Start concatenating every rank's ``arr`` along dim 0 (dim 0 may differ per rank)."""
    details = _invalid("allgather needs at least one dimension") if arr.ndim == 0 else (arr.dtype.name,
                                                                                       arr.shape[1:])
    return basics.submit("allgather", name, process_set, details, arr)


def grouped_allgather(arrays: Sequence[np.ndarray], name: Optional[str], process_set):
    """Start the allgather of each of ``arrays`` in one request."""
    arrays = list(arrays)
    details = tuple((a.dtype.name, a.shape[1:]) for a in arrays)
    if any(a.ndim == 0 for a in arrays):
        details = _invalid("allgather needs tensors with at least one dimension")
    return basics.submit("grouped_allgather", name, process_set, details, arrays)


def broadcast(arr: np.ndarray, root_rank: Any, name: Optional[str], process_set):
    """Start broadcasting world rank ``root_rank``'s ``arr`` over the set."""
    root = basics.root_details(root_rank, process_set)
    details = root if root[0] == "invalid" else (arr.dtype.name, arr.shape, root[0])
    return basics.submit("broadcast", name, process_set, details, arr)


def check_splits(arr: np.ndarray, splits: Optional[Sequence[int]], n: int):
    """Return ``(problem, counts)``: rows per destination rank, or the reason ``splits`` is unusable."""
    if arr.ndim == 0:
        return "alltoall needs at least one dimension", None
    rows = arr.shape[0]
    if splits is None:
        if rows % n:
            return f"alltoall without splits needs dim 0 ({rows}) divisible by the {n} ranks", None
        return "", [rows // n] * n
    counts = [int(s) for s in splits]
    if len(counts) != n or (counts and min(counts) < 0):
        return f"alltoall splits {counts} must be {n} non-negative counts", None
    if sum(counts) > rows:
        return f"alltoall splits {counts} sum to more than dim 0 ({rows})", None
    return "", counts


def alltoall(arr: np.ndarray, splits: Optional[Sequence[int]], name: Optional[str], process_set,
             problem: str = ""):
    """Start an alltoall: rows ``splits[i]`` go to rank i of the set (even split when None).

    ``problem``: the adapter's own objection to ``splits`` (e.g. its dtype).
    """
    counts = None
    if not problem:
        problem, counts = check_splits(arr, splits, set_size(process_set))
    details = _invalid(problem) if problem else (arr.dtype.name, arr.shape[1:])
    payload = (arr[:sum(counts)] if counts else arr, counts)
    return basics.submit("alltoall", name, process_set, details, payload)


def _reducescatter_details(arr: np.ndarray, op: str, pre: float, post: float) -> tuple:
    if arr.ndim == 0:
        return _invalid("reducescatter needs at least one dimension (it splits dim 0)")
    if op not in ("sum", "avg"):
        return _invalid(f"reducescatter supports op Sum and Average, not {op}")
    return (arr.dtype.name, arr.shape, op, float(pre), float(post))


def reducescatter(arr: np.ndarray, name: Optional[str], op: str, pre: float, post: float, process_set):
    """Start a reduce-scatter: this rank gets its block of dim 0 (the first ``dim0 % n`` ranks a row more)."""
    return basics.submit("reducescatter", name, process_set, _reducescatter_details(arr, op, pre, post), arr)


def grouped_reducescatter(arrays: Sequence[np.ndarray], name: Optional[str], op: str, pre: float, post: float,
                          process_set):
    """Start the reduce-scatter of each of ``arrays`` in one request."""
    arrays = list(arrays)
    each = [_reducescatter_details(a, op, pre, post) for a in arrays]
    bad = next((d for d in each if d[0] == "invalid"), None)
    details = bad or (tuple(d[:2] for d in each), op, float(pre), float(post))
    return basics.submit("grouped_reducescatter", name, process_set, details, arrays)


def barrier(process_set) -> None:
    """Return when every rank of ``process_set`` has entered the barrier."""
    basics.submit("barrier", None, process_set, (), None).wait()


def broadcast_object(obj: Any, root_rank: Any, name: Optional[str], process_set) -> Any:
    """Return world rank ``root_rank``'s picklable ``obj`` on every rank of the set."""
    return basics.submit("broadcast_object", name, process_set, basics.root_details(root_rank, process_set),
                         obj).wait()


def allgather_object(obj: Any, name: Optional[str], process_set) -> list:
    """Return every rank's picklable ``obj``, in the set's rank order."""
    return basics.submit("allgather_object", name, process_set, (), obj).wait()


def root_index(root_rank: Any, process_set) -> int:
    """Return the index in ``process_set`` of world rank ``root_rank`` (ValueError when it is not a member)."""
    details = basics.root_details(root_rank, process_set)
    if details[0] == "invalid":
        raise ValueError(details[1])
    return details[0]


def set_size(process_set) -> int:
    """Return the number of ranks of ``process_set``."""
    return len(process_set.ranks) if process_set.process_set_id else basics.size()


def set_rank(process_set) -> int:
    """Return this process's rank within ``process_set``."""
    return process_set.rank() if process_set.process_set_id else basics.rank()
