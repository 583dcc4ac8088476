"""Reduction operators and dtype rules shared by every algorithm.

All reductions run on numpy buffers.  Low-precision floats (float16 and
bfloat16) are accumulated in float32 and rounded once at the end, so a sum
over many ranks loses no more precision than one rounding; booleans reduce as
uint8 (min = logical and, max = logical or).  ``avg`` is a sum followed by one
division by the number of ranks, done identically on every rank so that
replicas stay bit-identical.
"""
from __future__ import annotations

import numpy as np

from ..tensors import is_bfloat16

__all__ = ["OPS", "check_op", "accumulation_dtype", "to_accumulator", "reduce_into",
           "finish", "segment_bounds"]

_UFUNCS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}
OPS = tuple(_UFUNCS)


def check_op(op: str, dtype: np.dtype) -> str:
    """Return ``op`` if it is valid for ``dtype``, else raise ValueError with the reason."""
    if op not in _UFUNCS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {', '.join(OPS)}")
    dtype = np.dtype(dtype)
    if dtype == np.bool_ and op not in ("min", "max"):
        raise TypeError(f"op={op!r} is not defined for bool tensors; use 'min' (and) or 'max' (or)")
    if op == "avg" and dtype.kind in "iu":
        raise TypeError(f"op='avg' needs a floating-point tensor, got {dtype}; use op='sum' and divide")
    return op


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """Return the dtype in which values of ``dtype`` are reduced.

    float16 and bfloat16 accumulate in float32; bool in uint8; others as is.
    """
    acc = _ACC.get(dtype)
    if acc is None:
        acc = np.dtype(dtype)
        if acc == np.float16 or is_bfloat16(acc):
            acc = np.dtype(np.float32)
        elif acc == np.bool_:
            acc = np.dtype(np.uint8)
        _ACC[dtype] = acc
    return acc


_ACC: dict = {}


def to_accumulator(buf: np.ndarray) -> np.ndarray:
    """Return a fresh flat copy of ``buf`` in its accumulation dtype (never a view of the input)."""
    acc = accumulation_dtype(buf.dtype)
    return np.array(buf.reshape(-1), dtype=acc, copy=True)


def reduce_into(acc: np.ndarray, other: np.ndarray, op: str) -> None:
    """Reduce ``other`` into ``acc`` in place: ``acc = acc (op) other``.  Cost: one pass over ``acc``."""
    _UFUNCS[op](acc, other, out=acc)


def finish(acc: np.ndarray, op: str, nranks: int, dtype: np.dtype) -> np.ndarray:
    """Turn an accumulated buffer into the final result: divide for ``avg``, cast back to ``dtype``."""
    if op != "avg" and acc.dtype == dtype:     # (the common case, on the path of every small all-reduce)
        return acc
    if op == "avg" and nranks > 1:
        np.divide(acc, acc.dtype.type(nranks), out=acc)
    dtype = np.dtype(dtype)
    return acc if acc.dtype == dtype else acc.astype(dtype)


def segment_bounds(count: int, parts: int) -> np.ndarray:
    """Return ``parts + 1`` offsets splitting ``count`` items as evenly as possible.

    The first ``count % parts`` segments get one extra item, as ``np.array_split``
    does; segments may be empty when ``count < parts``.
    """
    base, extra = divmod(int(count), int(parts))
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate(([0], np.cumsum(sizes)))
