"""Gradient buckets: which tensors are all-reduced together, decided once from their sizes.

Framework adapters (PyTorch, TensorFlow) pack the gradients of one bucket into
one flat buffer and all-reduce it with one collective, so many small tensors
cost one message latency instead of many.  The plan depends only on the
tensors' sizes, dtypes and devices in registration order, so every rank
computes the same plan without communicating.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, List, Sequence, Tuple

__all__ = ["Bucket", "plan_buckets"]


@dataclass
class Bucket:
    """Tensors all-reduced together: their indices, element offsets in the flat buffer and sizes."""

    index: int
    kind: Hashable                      # (dtype, device) or any key the adapter groups by
    members: List[int] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    numels: List[int] = field(default_factory=list)
    numel: int = 0

    def add(self, member: int, numel: int) -> None:
        """Append tensor ``member`` of ``numel`` elements at the end of the flat buffer."""
        self.members.append(member)
        self.offsets.append(self.numel)
        self.numels.append(numel)
        self.numel += numel


def plan_buckets(tensors: Sequence[Tuple[int, int, Hashable]], cap_bytes: int) -> List[Bucket]:
    """Group tensors into buckets of at most ``cap_bytes``, in reverse registration order.

    Gradients become ready roughly in reverse order of parameter registration
    (the last layer's first), so filling buckets from the end, as PyTorch DDP
    does, lets the first bucket be all-reduced while backward still computes
    the others.  Tensors of a different kind (dtype, device) never share a
    bucket; a tensor larger than the cap gets a bucket of its own.

    Args:
        tensors: ``(numel, itemsize, kind)`` per tensor, in registration order.
        cap_bytes: bucket size limit; 0 puts every tensor in its own bucket.

    Returns:
        The buckets in the order they should be launched.  Cost: O(len(tensors)).
    """
    buckets: List[Bucket] = []
    open_by_kind = {}
    for i in reversed(range(len(tensors))):
        numel, itemsize, kind = tensors[i]
        b = open_by_kind.get(kind)
        if b is None or (b.members and (b.numel + numel) * itemsize > cap_bytes):
            b = Bucket(len(buckets), kind)
            buckets.append(b)
            open_by_kind[kind] = b
        b.add(i, int(numel))
    return buckets
