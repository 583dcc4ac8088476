"""Result arrays of large collectives, reused once the caller has let go of them.

A fresh large array is not free: the kernel hands out zeroed pages on first
touch, so writing a new 64 MiB result costs about twice a memcpy of it (and
glibc unmaps large blocks on free, so every call pays again).  A collective
that returns a new array therefore takes its memory from here: a few byte
buffers of at least ``min_bytes``, each handed out again only when no view of
it is alive (CPython's reference count: the pool's own references and nothing
else).  Results stay ordinary numpy arrays that the caller owns for as long as
it keeps them; the pool never writes into one that is still referenced.

Memory: at most ``keep`` buffers stay allocated after their results are gone
(the largest results seen; by default 2, from 1 MiB).
"""
from __future__ import annotations

import sys
from typing import List

import numpy as np

__all__ = ["ResultBuffers"]

_FREE_REFS = 3     # the pool's list, the loop variable, getrefcount's argument


class ResultBuffers:
    """A small pool of byte buffers for results (see module docstring).

    Args:
        min_bytes: smaller results are plain ``np.empty`` (the allocator reuses small blocks itself).
        keep: how many buffers the pool holds at most.
    """

    def __init__(self, min_bytes: int = 1 << 20, keep: int = 2):
        self.min_bytes, self.keep = int(min_bytes), int(keep)
        self._bufs: List[np.ndarray] = []

    def empty(self, count: int, dtype) -> np.ndarray:
        """Return an uninitialised flat array of ``count`` values of ``dtype`` (from the pool when large)."""
        dtype = np.dtype(dtype)
        nbytes = int(count) * dtype.itemsize
        if nbytes < self.min_bytes:
            return np.empty(count, dtype=dtype)
        for buf in self._bufs:
            # a buffer at most twice too large, so a small result does not pin a huge one
            if nbytes <= buf.size <= 2 * nbytes and sys.getrefcount(buf) == _FREE_REFS:
                return buf[:nbytes].view(dtype)
        buf = np.empty(nbytes, dtype=np.uint8)
        self._bufs.append(buf)
        if len(self._bufs) > self.keep:                      # drop the oldest from the pool
            self._bufs.pop(0)
        return buf.view(dtype)
