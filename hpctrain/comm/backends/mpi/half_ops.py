"""MPI reduction ops for 16-bit floats, which the MPI standard has no datatype for.

The library path ("native") hands float16 and bfloat16 buffers to MPI as an
unsigned 16-bit MPI datatype with a user-defined op (``MPI_Op_create``,
commutative) that reduces each pair the way every other path does
(:func:`hpctrain.collectives.ops.pairwise`: in float32, rounded once to the
16-bit type), so the wire carries 2 bytes a value and the bits do not depend
on the MPI build (Open MPI
5 knows float16 as an extension, MPICH too, bfloat16 neither).  The MPI
library calls the op on each piece it combines, from the calling thread:
one Python call a piece (microseconds) beside the element work.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ....half import is_half
from ....collectives.ops import pairwise

__all__ = ["HalfOps"]


class HalfOps:
    """The user-defined MPI ops of one process, made on first use (``MPI_Op_create`` is local, not collective)."""

    def __init__(self, MPI):
        self._MPI = MPI
        self._made: Dict[Tuple[str, str], object] = {}

    def args(self, buf: np.ndarray, op: str, library_op):
        """Return ``(buffer, MPI op)`` for reducing ``buf`` with ``op``: a 16-bit float buffer as its uint16
        view and hpctrain's op for it; any other buffer and ``library_op`` as they are."""
        if buf.dtype.itemsize != 2 or not is_half(buf.dtype):     # (the first test: the common case's only cost)
            return buf, library_op
        key = (op, buf.dtype.str if buf.dtype == np.float16 else "bfloat16")
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._MPI.Op.Create(_reducer(pairwise(op, buf.dtype), buf.dtype), commute=True)
        return buf.view(np.uint16), made


def _reducer(ufunc, dtype: np.dtype):
    def reduce(inbuf, inoutbuf, datatype):
        ufunc(np.frombuffer(inbuf, dtype=dtype), np.frombuffer(inoutbuf, dtype=dtype),
              out=np.frombuffer(inoutbuf, dtype=dtype))
    return reduce
