"""Tensor fusion: many tensors all-reduced as a few large buffers.

One all-reduce per tensor pays the per-message latency (and, here, the call
check) once per tensor: for ResNet-50's 161 gradients most of them are far
too small to reach the link's bandwidth.  Fusion groups the tensors by dtype
into buffers of at most ``threshold`` bytes (``HPCTRAIN_FUSION_THRESHOLD``,
default 64 MiB; a tensor larger than that gets a buffer of its own) and runs
one collective per buffer.  Tuning: a larger threshold means fewer
collectives but a larger staging buffer per dtype; 16-64 MiB is past the
bandwidth knee on shared memory and on most networks.

The shared-memory algorithms read the tensors in place (see
:class:`hpctrain.collectives.flat.Flat`) and write the results into one buffer
from the communicator's result pool, which the outputs are views of (so a
warm buffer is reused, and one output kept alive keeps its whole buffer); the
others pack them into a staging
buffer that is allocated once per dtype and reused across calls (grown when a
call needs more), and unpack the results.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from .buckets import Bucket, plan_buckets

__all__ = ["FusionBuffers", "fusion_groups"]


def fusion_groups(arrays: Sequence[np.ndarray], threshold: int) -> List[Bucket]:
    """Return the fusion buffers for ``arrays``: tensors of one dtype, at most ``threshold`` bytes each.

    Depends only on the arrays' sizes and dtypes, so every rank plans the same
    groups without communicating.  Cost: O(len(arrays)).
    """
    return plan_buckets([(a.size, a.itemsize, a.dtype.str) for a in arrays], threshold)


class FusionBuffers:
    """Staging buffers, one per dtype, reused across calls."""

    def __init__(self) -> None:
        self._buffers: Dict[str, np.ndarray] = {}

    def get(self, dtype, count: int) -> np.ndarray:
        """Return a flat buffer of ``count`` elements of ``dtype`` (valid until the next ``get`` of that dtype)."""
        dtype = np.dtype(dtype)
        buf = self._buffers.get(dtype.str)
        if buf is None or buf.size < count:
            buf = np.empty(1 << max(10, (count - 1).bit_length()), dtype=dtype)
            self._buffers[dtype.str] = buf
        return buf[:count]

    def pack(self, arrays: Sequence[np.ndarray], group: Bucket) -> np.ndarray:
        """Copy the members of ``group`` into one staging buffer and return it."""
        buf = self.get(arrays[group.members[0]].dtype, group.numel)
        for i, off, n in zip(group.members, group.offsets, group.numels):
            buf[off:off + n] = arrays[i].reshape(-1)
        return buf
