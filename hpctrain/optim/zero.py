"""ZeRO sharding of an optimizer over the data-parallel ranks: which elements each rank owns, on flat buffers.

The gradients of one optimizer are already grouped into buckets
(:mod:`hpctrain.collectives.buckets`); ZeRO splits every bucket's flat buffer
of ``n`` elements into ``N`` equal chunks of ``c = ceil(n / N)`` elements, the
last one padded: rank ``r`` owns elements ``[r c, min((r + 1) c, n))`` of
every bucket.  Shards are balanced to one element per bucket whatever the
parameter sizes (torch's ZeroRedundancyOptimizer assigns whole parameters, so
its shards differ by up to the largest parameter).

Per step, for a bucket (``m`` tensors):

* reduce-scatter: the bucket's gradients are packed as an ``N x (c + m)``
  array, row ``r`` holding chunk ``r`` followed by the ``m`` has-gradient flags
  (the same flags in every row), and reduce-scattered: each rank receives its
  own chunk, reduced, and the flags summed over the ranks;
* the optimizer steps on the owned chunk only (its state: ``1/N`` of the
  unsharded optimizer's);
* allgather: every rank's updated chunk (padded to ``c``) is all-gathered;
  the result's first ``n`` elements are the bucket's flat parameters.

Cost per step: ``(N-1)/N`` of the gradient bytes sent by the reduce-scatter
plus ``(N-1)/N`` of the parameter bytes by the allgather: the bytes of one
ring all-reduce.  Memory: optimizer state ``1/N``; with stage 2 gradients
``1/N`` plus the buckets in flight.

Everything here is arithmetic on indices and numpy arrays; the framework
adapters (:mod:`hpctrain.torch.zero`) move their tensors through it.
"""
from __future__ import annotations

from typing import Iterator, List, Sequence, Tuple

import numpy as np

from ..checkpoint.spread import SHARDS_FORMAT     # (the mark of a sharded state in a checkpoint: see layout_record)

__all__ = ["ShardLayout", "Exchange", "per_element", "layout_record", "reshard_copies",
           "refuse_compression", "SHARDS_FORMAT"]


class ShardLayout:
    """The chunks of each bucket and the one rank ``rank`` of ``size`` owns.

    Args:
        numels: elements of each bucket's gradients (without flags).
        size, rank: the data-parallel group.
    """

    def __init__(self, numels: Sequence[int], size: int, rank: int):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of size {size} is not a rank of a group")
        self.numels, self.size, self.rank = [int(n) for n in numels], size, rank
        self.chunks = [max(1, -(-n // size)) for n in self.numels]

    def own(self, b: int, rank: int = -1) -> Tuple[int, int]:
        """The element range ``[lo, hi)`` of bucket ``b`` that ``rank`` (default: this rank) owns."""
        r = self.rank if rank < 0 else rank
        c, n = self.chunks[b], self.numels[b]
        return min(r * c, n), min((r + 1) * c, n)

    def own_numel(self, b: int) -> int:
        """Elements of bucket ``b`` this rank owns (0 when the bucket has fewer elements than ranks before it)."""
        lo, hi = self.own(b)
        return hi - lo

    def segments(self, b: int, offset: int, numel: int) -> Iterator[Tuple[int, int, int, int]]:
        """Where elements ``[offset, offset + numel)`` of bucket ``b`` lie in its ``N x c`` chunk rows.

        Yields ``(row, column, source offset, length)``: the tensor's elements
        ``[source, source + length)`` go to ``row``'s columns
        ``[column, column + length)``.
        """
        c = self.chunks[b]
        pos, end = offset, offset + numel
        while pos < end:
            row, col = divmod(pos, c)
            length = min(c - col, end - pos)
            yield row, col, pos - offset, length
            pos += length

    def own_parts(self, b: int, offset: int, numel: int) -> Tuple[int, int, int, int]:
        """Elements ``[offset, offset + numel)`` of bucket ``b`` in this rank's chunk:
        ``(chunk lo, chunk hi, tensor lo, tensor hi)``, empty ranges when it owns none of them."""
        own_lo, own_hi = self.own(b)
        lo, hi = max(own_lo, offset), min(own_hi, offset + numel)
        if lo >= hi:
            return 0, 0, 0, 0
        return lo - own_lo, hi - own_lo, lo - offset, hi - offset


def refuse_compression(compression) -> None:
    """Raise ValueError for any compressor: hpctrain's are defined for all-reduce (error feedback on the whole
    gradient), not for a reduce-scatter's chunks."""
    if compression is not None:
        raise ValueError(f"ShardedOptimizer reduce-scatters the gradients; compression ({compression!r}) is "
                         "defined for all-reduce only: use DistributedOptimizer(compression=...) or no compression")


def per_element(key: str, value, shape: Sequence[int]) -> bool:
    """Whether optimizer state ``key`` of a tensor of ``shape`` is per element (a moment) or one for the tensor.

    Per element: an array of the tensor's own shape, but for ``"step"`` (the
    step counters of torch's and Keras's optimizers are per tensor, whatever
    its shape).
    """
    return key != "step" and tuple(getattr(value, "shape", (None,))) == tuple(shape)


class Exchange:
    """ZeRO's two collectives for buckets of numpy arrays (the Keras adapter's path; torch packs its own tensors).

    Without has-gradient flags: a caller passes zeros for a tensor without a
    gradient.  ``buckets`` are :class:`~hpctrain.collectives.buckets.Bucket`
    objects of the tensors, ``layout`` their :class:`ShardLayout` over ``comm``.
    """

    def __init__(self, comm, layout: ShardLayout, buckets):
        self.comm, self.layout, self.buckets = comm, layout, buckets

    def reduce_scatter(self, arrays: Sequence[np.ndarray], op: str = "avg") -> List[np.ndarray]:
        """This rank's chunk of every bucket of ``arrays`` (all tensors, in order), reduced over the ranks.

        Cost: one reduce-scatter per bucket, ``(N-1)/N`` of the bucket's bytes sent.
        """
        out = []
        for b, bucket in enumerate(self.buckets):
            c = self.layout.chunks[b]
            first = arrays[bucket.members[0]]
            rows = np.zeros(self.layout.size * c, dtype=first.dtype)
            for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels):
                rows[off:off + n] = np.asarray(arrays[i]).reshape(-1)
            mine = self.comm.reduce_scatter(rows.reshape(self.layout.size, c), op=op)
            out.append(np.ascontiguousarray(mine.reshape(-1)[:self.layout.own_numel(b)]))
        return out

    def allgather(self, chunks: Sequence[np.ndarray]) -> List[np.ndarray]:
        """Every bucket's flat values from every rank's chunk of it (``chunks``: this rank's, one per bucket)."""
        return [self.gather(b, chunk) for b, chunk in enumerate(chunks)]

    def gather(self, b: int, chunk: np.ndarray) -> np.ndarray:
        """Bucket ``b``'s flat values (or those of any per-element state of it) from every rank's chunk."""
        padded = np.zeros(self.layout.chunks[b], dtype=chunk.dtype)
        padded[:len(chunk)] = chunk
        return self.comm.allgather(padded)[:self.layout.numels[b]]


def layout_record(layout: ShardLayout, buckets, index_of: Sequence[int]) -> List[dict]:
    """What a checkpoint keeps of a sharding, so that another one can take its chunks: per bucket its elements,
    chunk size, and its tensors as ``[tensor index, offset, numel]`` (``index_of``: each tensor's index)."""
    return [{"numel": layout.numels[b], "chunk": layout.chunks[b],
             "members": [[int(index_of[i]), int(off), int(n)] for i, off, n in zip(bk.members, bk.offsets, bk.numels)]}
            for b, bk in enumerate(buckets)]


def reshard_copies(saved: Sequence[dict], layout: ShardLayout, buckets, index_of: Sequence[int]
                   ) -> Iterator[Tuple[int, int, int, int, int, int]]:
    """The copies that fill this rank's chunks from the chunks of a saved sharding (:func:`layout_record`).

    Yields ``(bucket, lo, hi, saved rank, saved bucket, saved lo)``: elements
    ``[lo, hi)`` of this rank's chunk of ``bucket`` are elements
    ``[saved lo, saved lo + hi - lo)`` of ``saved rank``'s chunk of ``saved
    bucket``.  The world size, bucket sizes and order may differ; tensors are
    matched by index.  Raises ValueError for a tensor the record lacks or whose
    size differs.  Cost: O(tensors + copies), no data touched.
    """
    where = {}
    for sb, rec in enumerate(saved):
        for idx, off, n in rec["members"]:
            where[int(idx)] = (sb, int(off), int(n))
    for b, bucket in enumerate(buckets):
        for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels):
            lo, hi, plo, phi = layout.own_parts(b, off, n)
            if lo >= hi:
                continue
            idx = int(index_of[i])
            if idx not in where or where[idx][2] != n:
                raise ValueError(f"the saved sharding has no tensor {idx} of {n} elements "
                                 f"(it has {where.get(idx, (None, None, 'none'))[2]})")
            sb, soff, _ = where[idx]
            c = int(saved[sb]["chunk"])
            pos, end = soff + plo, soff + phi       # (the tensor's elements, in the saved bucket's coordinates)
            while pos < end:
                rank, col = divmod(pos, c)
                length = min(c - col, end - pos)
                yield b, lo, lo + length, rank, sb, col
                lo += length
                pos += length

