"""16-bit floats (float16, bfloat16): their pairwise sums and their casts from and to float32, in C where built.

Every all-reduce path keeps float16 and bfloat16 as they are (2 bytes a
value between ranks, :mod:`hpctrain.collectives.ops`) and adds a pair by
widening both to float32, adding, and rounding the sum once to the 16-bit
type, to nearest even; the casting compressors (``fp16``, ``bf16``) narrow
float32 gradients the same way and widen the sums back.  numpy's float16 and
ml_dtypes' bfloat16 loops do exactly that one value at a time;
``_half_kernel.c`` (built by setup.py where a C compiler is; optional) gives
the same bits with x86's F16C conversions, 8 values an instruction, or a
vectorised bfloat16 rounding: a float16 sum about 50x and a cast 5-20x faster
than numpy's, so that the sums and casts cost less than the bytes they save.
Cost: one pass over the buffers, memory-bound.
"""
from __future__ import annotations

import numpy as np

from .tensors import is_bfloat16

try:        # (built by setup.py when a C compiler is there; numpy's loops give the same bits without it)
    from . import _half_kernel
except ImportError:     # pragma: no cover - a build without a compiler
    _half_kernel = None

__all__ = ["is_half", "half_sum", "narrow", "widen"]

_TO_F16, _FROM_F16, _TO_BF16, _FROM_BF16 = range(4)


def is_half(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a 16-bit float (float16 or bfloat16)."""
    dtype = np.dtype(dtype)
    return dtype.itemsize == 2 and (dtype == np.float16 or is_bfloat16(dtype))


def half_sum(dtype: np.dtype):
    """``f(a, b, out=o, casting=...)``: ``o = round16(float32(a) + float32(b))`` over buffers of the 16-bit float
    ``dtype``, in C (numpy's loop where the kernel was not built; a buffer that is not contiguous too)."""
    if _half_kernel is None:
        return np.add
    bf16 = is_bfloat16(dtype)

    def add(a, b, out, casting=None):
        if a.flags.c_contiguous and b.flags.c_contiguous and out.flags.c_contiguous and a.shape == b.shape == out.shape:
            _half_kernel.add(a.view(np.uint16), b.view(np.uint16), out.view(np.uint16), bf16)
        else:
            np.add(a, b, out=out)
    return add


def narrow(x: np.ndarray, dtype) -> np.ndarray:
    """A new array of ``x`` (float32) rounded to the 16-bit float ``dtype`` (to nearest even; ``x.astype``'s bits)."""
    dtype = np.dtype(dtype)
    if _half_kernel is None or x.dtype != np.float32 or not x.flags.c_contiguous or not is_half(dtype):
        return x.astype(dtype)
    out = np.empty(x.shape, dtype)
    _half_kernel.convert(x, out.view(np.uint16), _TO_BF16 if is_bfloat16(dtype) else _TO_F16)
    return out


def widen(x: np.ndarray) -> np.ndarray:
    """A new float32 array of ``x`` (a 16-bit float array; ``x.astype(np.float32)``'s bits)."""
    if _half_kernel is None or not x.flags.c_contiguous or not is_half(x.dtype):
        return x.astype(np.float32)
    out = np.empty(x.shape, np.float32)
    _half_kernel.convert(x.view(np.uint16), out, _FROM_BF16 if is_bfloat16(x.dtype) else _FROM_F16)
    return out
