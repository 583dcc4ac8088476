"""The gradient side of :func:`hpctrain.torch.ShardedOptimizer`: buckets reduce-scattered into each rank's shard.

:class:`ZeroSync` is :class:`~hpctrain.torch.gradient_sync.GradientSync` (the
same autograd hooks, bucket plan and launch order) with a different bucket
reduction, ZeRO's (:mod:`hpctrain.optim.zero`): a bucket is packed as
``N x (c + m)`` rows (chunk ``r`` of its gradients and the has-gradient
flags) and reduce-scattered through the averager's bucket strategy ("reduce_scatter"); the result
is this rank's chunk of the averaged gradients, which becomes the gradient of
its shard.  Buckets never mix parameter groups, so a shard has one group's
hyperparameters.

A bucket's rows buffer is made when the bucket launches and dropped once its
chunk is applied; at most ``IN_FLIGHT`` buckets are in flight during
backward.  Stage 1 leaves the parameters' own (local, not averaged) gradients
alone; stage 2 drops each parameter's gradient once it is packed: gradient
memory is this rank's chunks plus the buckets in flight.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..gradients import GradientAverager
from ..optim.zero import ShardLayout
from .gradient_sync import GradientSync

__all__ = ["ZeroSync"]

IN_FLIGHT = 4       # buckets reduce-scattering at once during backward


class ZeroSync(GradientSync):
    """Buckets of one sharded optimizer: packing into rows, reduce-scatter, this rank's chunk as shard gradients."""

    def __init__(self, optimizer, named_parameters, comm, passes_per_step: int, cap_bytes: int, stage: int):
        self.stage = stage
        self._group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
        super().__init__(optimizer, named_parameters, GradientAverager(comm, "avg", bucket_strategy="reduce_scatter"),
                         passes_per_step, cap_bytes)
        self.layout = ShardLayout([b.numel for b in self.buckets], self.comm.size, self.comm.rank)
        self.group = [self._group_of[id(self.params[b.members[0]])] for b in self.buckets]
        self.shard_grads: List[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self.without_grad: List[List[Tuple[int, int]]] = [[] for _ in self.buckets]

    def _kind(self, param) -> tuple:
        return param.dtype, param.device, self._group_of[id(param)]

    def _bucket_buffer(self, bucket):
        return None         # (the rows are made by _rows)

    def _rows(self, b: int) -> torch.Tensor:
        """A rows buffer for bucket ``b``, its padding zeroed."""
        bucket, layout = self.buckets[b], self.layout
        dtype, device, _ = bucket.kind
        c, m = layout.chunks[b], len(bucket.members)
        rows = torch.empty((layout.size, c + m), dtype=dtype, device=device)
        for row, col, _, n in layout.segments(b, bucket.numel, layout.size * c - bucket.numel):
            rows[row, col:col + n].zero_()
        return rows

    def reset(self) -> None:
        super().reset()
        self.applied = 0

    def _launch(self, b: int) -> None:
        rows = self._rows(b)
        self._pack_rows(b, rows)
        self.handles[b] = self.averager.start_bucket(rows, self.buckets[b], self.names, self.shapes)
        self.launched = b + 1
        while self.launched - self.applied > IN_FLIGHT:
            self._apply_next()

    def _pack_rows(self, b: int, rows: torch.Tensor) -> None:
        """Copy bucket ``b``'s gradients into its chunk rows (divided by the passes), its flags into every row."""
        bucket, layout = self.buckets[b], self.layout
        c = layout.chunks[b]
        with torch.no_grad():
            for j, (i, off, n) in enumerate(zip(bucket.members, bucket.offsets, bucket.numels)):
                p = self.params[i]
                g = p.grad
                flat = None if g is None else (g.to_dense() if g.is_sparse else g).reshape(-1)
                for row, col, src, length in layout.segments(b, off, n):
                    if flat is None:
                        rows[row, col:col + length].zero_()
                    else:
                        rows[row, col:col + length].copy_(flat[src:src + length])
                rows[:, c + j] = 0 if g is None else 1
                if self.stage == 2:
                    p.grad = None
            if self.passes > 1:
                rows[:, :c].div_(self.passes)

    def _apply_next(self) -> None:
        b = self.applied
        self.apply(b, self.handles[b].wait())
        self.handles[b] = None
        self.applied = b + 1

    def synchronize(self) -> None:
        """Launch what is left and make every shard's gradient its reduced chunk."""
        if self.synchronized:
            return
        self._launch_upto(len(self.buckets))
        while self.applied < len(self.buckets):
            self._apply_next()
        self.synchronized = True
        self.averager.count_step()

    def apply(self, b: int, reduced: torch.Tensor) -> None:
        """Keep this rank's reduced chunk of bucket ``b`` and where in it no rank had a gradient."""
        bucket, layout = self.buckets[b], self.layout
        row = reduced.reshape(-1)
        c, m = layout.chunks[b], len(bucket.members)
        half = 0.5 / layout.size
        has = [v > half for v in row[c:c + m].tolist()]
        self.shard_grads[b] = row[:layout.own_numel(b)]
        gaps = [layout.own_parts(b, off, n)[:2] for j, (off, n) in enumerate(zip(bucket.offsets, bucket.numels))
                if not has[j]]
        self.without_grad[b] = [(lo, hi) for lo, hi in gaps if lo < hi]

    def shadow(self) -> None:
        raise NotImplementedError("hpctrain.torch.Join does not work with ShardedOptimizer yet: give every rank "
                                  "the same number of batches (hpctrain.data.DistributedSampler(drop_last=True))")
