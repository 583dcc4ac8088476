"""Reduction operators and dtype rules shared by every algorithm.

All reductions run on numpy buffers.  Low-precision floats (float16 and
bfloat16) stay 2 bytes a value in every buffer the algorithms move between
ranks and nodes (half the bytes of float32, as NCCL, Horovod's float16 op and
DDP's ``fp16_compress_hook`` send them): each reduction of two buffers
(:func:`reduce_into`, a hop of the ring, a rank's turn in shared memory)
computes every pair in float32 and rounds it once to the 16-bit type (numpy's
float16 and ml_dtypes' bfloat16 ufuncs do exactly that, and
:mod:`hpctrain.half`'s C kernel the same bits, faster).  A sum over ``n``
ranks is ``n - 1`` such additions in a fixed order, whatever the algorithm, so
against the exact sum (float64)

    |result - sum_i x_i| <= g sum_i |x_i|,   g = k u' / (1 - k u'),  k = n - 1,  u' = u + 2^-23

with ``u`` = 2^-11 for float16 and 2^-8 for bfloat16 (a unit roundoff per
hop; the float32 sum before it adds 2^-24; a float16 partial sum below 2^-14,
its subnormal range, adds at most 2^-25 more each); ``avg`` against the mean,
in units of the mean of ``|x_i|``, has one rounding more (k = n: the division).
Summing in float32 and rounding once would give ``u`` alone, at twice the
bytes; a caller that needs it all-reduces a float32 copy.  Booleans reduce as
uint8 (min = logical and, max = logical or).  ``avg`` is a sum followed by one
division by the number of ranks, done identically on every rank so that
replicas stay bit-identical.
"""
from __future__ import annotations

import numpy as np

from ..half import half_sum, is_half

__all__ = ["OPS", "check_op", "accumulation_dtype", "is_half", "to_accumulator", "reduce_into", "pairwise",
           "finish", "divide", "segment_bounds"]

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
    """Return the dtype of the buffers in which values of ``dtype`` are reduced and sent between ranks.

    bool as uint8; others, float16 and bfloat16 included, as they are (each
    pair is added in float32 and rounded once: module docstring).
    """
    acc = _ACC.get(dtype)
    if acc is None:
        acc = np.dtype(dtype)
        if acc == np.bool_:
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
    pairwise(op, acc.dtype)(acc, other, out=acc)


def pairwise(op: str, dtype: np.dtype):
    """``f(a, b, out=o, casting=...)``, ``o = a (op) b`` over buffers of ``dtype``: numpy's ufunc, or for sums of
    float16 and bfloat16 :func:`hpctrain.half.half_sum` (the same bits, in C)."""
    if op in ("sum", "avg") and dtype.itemsize == 2 and is_half(dtype):
        return _HALF_SUMS.get(dtype) or _HALF_SUMS.setdefault(dtype, half_sum(dtype))
    return _UFUNCS[op]


_HALF_SUMS: dict = {}


def finish(acc: np.ndarray, op: str, nranks: int, dtype: np.dtype) -> np.ndarray:
    """Turn an accumulated buffer into the final result: divide for ``avg``, cast back to ``dtype``."""
    if op != "avg" and acc.dtype == dtype:     # (the common case, on the path of every small all-reduce)
        return acc
    if op == "avg" and nranks > 1:
        divide(acc, nranks, acc)
    dtype = np.dtype(dtype)
    return acc if acc.dtype == dtype else acc.astype(dtype)


def divide(acc: np.ndarray, divisor: int, out: np.ndarray) -> None:
    """``out = acc / divisor`` (the ``avg``), every path alike; a 16-bit float in float32, rounded once (bfloat16
    holds whole numbers exactly only up to 256, float16 up to 2048: the divisor itself must not be rounded)."""
    if is_half(acc.dtype):
        np.divide(acc, np.float32(divisor), out=out, casting="unsafe")
    else:
        np.divide(acc, acc.dtype.type(divisor), out=out)


def segment_bounds(count: int, parts: int) -> np.ndarray:
    """Return ``parts + 1`` offsets splitting ``count`` items as evenly as possible.

    The first ``count % parts`` segments get one extra item, as ``np.array_split``
    does; segments may be empty when ``count < parts``.
    """
    base, extra = divmod(int(count), int(parts))
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate(([0], np.cumsum(sizes)))
