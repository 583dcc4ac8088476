"""Several flat arrays seen as one buffer laid end to end, so that a fused group needs no packing copy.

The shared-memory all-reduces (:mod:`hpctrain.collectives.shm`) read and write
a group of tensors through it: element ``i`` of the group is element
``i - offsets[k]`` of part ``k``.  Cost: a lookup of the parts that cover a
range is O(log parts) (a binary search), then O(1) per part.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["Flat"]


class Flat:
    """Several flat arrays seen as one buffer laid end to end (a fused group needs no packing copy).

    Args:
        arrays: the parts, each C-contiguous; they are reshaped to 1-D views.
    """

    def __init__(self, arrays: Sequence[np.ndarray]):
        self.arrays = [a.reshape(-1) for a in arrays]
        self.offsets = np.concatenate(([0], np.cumsum([a.size for a in self.arrays], dtype=np.int64)))
        self.size = int(self.offsets[-1])

    def _spans(self, a: int, b: int):
        """Yield ``(index, lo, hi)`` in order: the pieces of the parts that cover elements ``[a, b)``."""
        i = max(0, int(np.searchsorted(self.offsets, a, side="right")) - 1)
        while a < b:
            while self.offsets[i + 1] <= a:
                i += 1
            base = int(self.offsets[i])
            hi = min(b, int(self.offsets[i + 1]))
            yield i, a - base, hi - base
            a = hi

    def addresses(self) -> np.ndarray:
        """Return the data address of every part (int64)."""
        return np.array([a.ctypes.data for a in self.arrays], dtype=np.int64)

    def spans(self, a: int, b: int) -> list:
        """Return ``[(index, lo, hi), ...]``: the pieces of the parts that cover elements ``[a, b)``, in order."""
        return list(self._spans(a, b))

    def views(self, spans) -> list:
        """Return ``[(view, offset), ...]`` for ``spans``: each piece and where it starts in the block they cover."""
        out, at = [], 0
        for i, lo, hi in spans:
            out.append((self.arrays[i][lo:hi], at))
            at += hi - lo
        return out

    def byte_spans(self, spans, addresses) -> list:
        """Return ``(address, bytes)`` of ``spans`` in a buffer laid out like this one at ``addresses``.

        ``addresses[i]`` is where part ``i`` starts in that buffer (another
        process's copy of the same layout, say).
        """
        size = self.arrays[0].itemsize
        return [(int(addresses[i]) + lo * size, (hi - lo) * size) for i, lo, hi in spans]

    def read(self, a: int, b: int, dest: np.ndarray) -> None:
        """Copy elements ``[a, b)`` into ``dest`` (casting to its dtype)."""
        k = 0
        for i, lo, hi in self._spans(a, b):
            np.copyto(dest[k:k + hi - lo], self.arrays[i][lo:hi], casting="unsafe")
            k += hi - lo

    def write(self, a: int, b: int, src: np.ndarray) -> None:
        """Copy ``src`` into elements ``[a, b)``."""
        k = 0
        for i, lo, hi in self._spans(a, b):
            np.copyto(self.arrays[i][lo:hi], src[k:k + hi - lo], casting="unsafe")
            k += hi - lo

    def block(self, a: int, b: int, scratch: np.ndarray) -> np.ndarray:
        """Return elements ``[a, b)``: a view when they lie in one part, else a copy in ``scratch``."""
        spans = self.spans(a, b)
        if len(spans) == 1:
            i, lo, hi = spans[0]
            return self.arrays[i][lo:hi]
        self.read(a, b, scratch[:b - a])
        return scratch[:b - a]
