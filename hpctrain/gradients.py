"""Gradient averaging for the framework adapters: buckets, compression, sparse rows and statistics.

The PyTorch and TensorFlow adapters convert tensors and hook into their
framework; how a step's gradients are reduced is decided here, once, on numpy
buffers (or on whatever tensors the communicator accepts):

* dense gradients: one grouped all-reduce per call (:meth:`GradientAverager.reduce`),
  or one collective per bucket (:meth:`GradientAverager.start_bucket`): a flat
  buffer of the bucket's gradients followed by its flags (:func:`bucket_length`),
  in the bucket plan of :mod:`hpctrain.collectives.buckets`;
* compression (``compression=``): gradients go through the compressor's
  :class:`~hpctrain.compression.CompressedReducer` (error-feedback residuals
  live in the compressor); flags always travel uncompressed;
* statistics: :meth:`GradientAverager.stats`, the same keys with or without a
  compressor;
* sparse gradients, one policy for both frameworks (below).

Formula: ``g = (1/N) sum_r g_r`` for ``op="avg"``, the plain sum for
``op="sum"``; ``op="adasum"`` combines the dense gradients with Adasum, tensor
by tensor (:class:`hpctrain.adasum_updates.AdasumUpdates`; what a gradient
tape offers: the optimizers combine their updates instead).  Cost of a dense
all-reduce: ``2 (N-1)/N`` x the gradient bytes sent per rank for ring-like
algorithms.

Sparse gradients (PyTorch sparse COO gradients, e.g. from
``nn.Embedding(sparse=True)``; TensorFlow ``tf.IndexedSlices``, e.g. from
``tf.gather`` and embedding lookups) travel as rows by default: every rank's
(indices, values) are all-gathered and the result is a sparse gradient holding
all ranks' rows, values divided by N for ``op="avg"``.  Duplicate indices are
summed when the optimizer applies it, so it equals the averaged dense
gradient.  Cost: each rank receives the rows of all ranks, ``N x rows x row
bytes``, against ``2 (N-1)/N x table bytes`` for a dense all-reduce: rows are
cheaper while N times the rows a rank touches stays well under the table's
rows.  ``sparse_as_dense=True`` densifies sparse gradients first and reduces
them with the dense ones (better when most rows are touched, and the only way
to compress them: rows are never compressed); torch gets the result back as
a sparse tensor again, TensorFlow as a dense one.  On one rank nothing is sent and
a sparse gradient stays sparse.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .adasum_updates import AdasumUpdates
from .bucket_strategies import Compressed, strategy_for
from .collectives.buckets import Bucket
from .compression import Policy, gradient_compressor, reducer_for

__all__ = ["GradientAverager", "bucket_length", "no_rows"]


def bucket_length(bucket: Bucket) -> int:
    """Elements of a bucket's flat buffer: its gradients, then a has-gradient and an is-sparse flag per tensor."""
    return bucket.numel + 2 * len(bucket.members)


class GradientAverager:
    """The reduction of one optimizer's gradients over ``comm``; both adapters' wrappers hold one.

    Args:
        comm: the communicator (default: the world).
        op: ``"avg"`` or ``"sum"`` over ranks (``"adasum"``: :meth:`reduce` only, no buckets).
        compression: a compressor of :mod:`hpctrain.compression`, its name, or None.
        policy: which tensors the compressor takes (default :class:`~hpctrain.compression.Policy`).
        sparse_as_dense: densify sparse gradients instead of gathering their rows (module docstring).
        bucket_strategy: how :meth:`start_bucket` reduces a bucket (:mod:`hpctrain.bucket_strategies`: a name
            or a strategy object, such as ZeRO's reduce-scatter or local SGD's); default: the communicator's
            own (``comm.bucket_strategy``), wrapped in the compressor's reduction when there is one.
    """

    def __init__(self, comm=None, op: str = "avg", compression=None, policy: Optional[Policy] = None,
                 sparse_as_dense: bool = False, bucket_strategy: Any = None):
        from .world import comm_or_world

        if bucket_strategy is not None and op == "adasum":
            raise ValueError(f"op='adasum' combines whole tensors, not buckets: it takes no bucket strategy "
                             f"(got {bucket_strategy!r})")
        self.adasum = AdasumUpdates(comm, compression) if op == "adasum" else None
        self.compressor = gradient_compressor(op, compression) if self.adasum is None else None
        self.comm, self.op, self.sparse_as_dense = comm_or_world(comm), op, bool(sparse_as_dense)
        self.reducer = reducer_for(self.compressor, self.comm, policy) if self.compressor is not None else None
        self.chosen_strategy = bucket_strategy      # (what a rebuild over a re-formed world keeps)
        strategy = strategy_for(self.comm.bucket_strategy) if bucket_strategy is None else \
            strategy_for(bucket_strategy) if isinstance(bucket_strategy, str) else bucket_strategy
        self.bucket_strategy = strategy if self.reducer is None else Compressed(strategy, self.reducer)
        self.steps = 0
        self._sent = 0

    @property
    def communicates(self) -> bool:
        """Whether reductions do any work: more than one rank, or a compressor (it runs on one rank too)."""
        return self.comm.size > 1 or self.reducer is not None

    def reduce(self, arrays: Sequence[np.ndarray], names: Sequence[str]) -> List[np.ndarray]:
        """Return the dense ``arrays`` (named for the compressor) reduced over ranks; counts one step.

        Without a compressor: one :meth:`Communicator.grouped_allreduce`; with
        one: the compressed reduction of copies of the arrays.
        """
        if self.adasum is not None:
            self.steps += 1
            return self.adasum.combine(arrays)
        self.count_step()
        if not len(arrays):
            return []
        if self.reducer is None:
            if self.comm.size == 1:
                return list(arrays)
            self._sent += sum(a.nbytes for a in arrays)
            return list(self.comm.grouped_allreduce([np.require(a, requirements="C") for a in arrays], op=self.op))
        copies = [np.array(a, copy=True, order="C") for a in arrays]
        return self.reducer.reduce(list(zip(names, copies)), op=self.op)

    def start_bucket(self, flat: Any, bucket: Bucket, names: Sequence[str], shapes: Sequence[tuple]):
        """Start reducing one bucket's flat buffer through the bucket strategy; the result's ``wait()`` returns
        the reduced buffer (``flat`` itself, reduced in place, for the all-reduce strategies).

        Without a compressor ``flat`` may be any tensor the communicator takes
        (reduced whole, flags included); with one it is a writable float numpy
        array whose gradients are compressed by name while its flags are
        all-reduced uncompressed (:class:`~hpctrain.bucket_strategies.Compressed`).
        """
        if self.reducer is None and self.comm.size > 1:
            self._sent += bucket.numel * flat.itemsize
        return self.bucket_strategy(self.comm, flat, bucket, names, shapes, self.op)

    def flags(self, values: Sequence[float]) -> Tuple[List[bool], List[bool], List[bool]]:
        """Per tensor of a reduced bucket: did any rank have a gradient, send rows, have a dense one.

        ``values`` are the bucket's last ``2 m`` elements.  Each rank sets its
        flags to 0 or 1; they are reduced with the gradients, so after
        ``op="avg"`` a flag is k/N for k ranks that set it.
        """
        m = len(values) // 2
        half = 0.5 / self.comm.size if self.op == "avg" else 0.5
        has, rows = values[:m], values[m:]
        return [h > half for h in has], [s > half for s in rows], [h - s > half for h, s in zip(has, rows)]

    def gather_rows(self, indices: np.ndarray, values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The sparse policy: every rank's rows, ``(indices, values)`` concatenated in rank order.

        ``indices`` (1-D) has one entry per row of ``values``; ranks may pass
        different numbers of rows, with the same trailing shape and dtypes.
        Values are divided by N for ``op="avg"``.  Cost: two all-gathers.
        """
        comm = self.comm
        if comm.size == 1:
            return indices, values
        if self.adasum is not None:
            raise NotImplementedError("Adasum does not combine sparse gradients (rows); pass sparse_as_dense=True")
        self._sent += indices.nbytes + values.nbytes
        all_values = comm.allgather(np.ascontiguousarray(values))
        all_indices = comm.allgather(np.ascontiguousarray(indices))
        if self.op == "avg":
            all_values = (all_values / comm.size).astype(all_values.dtype)
        return all_indices, all_values

    def count_step(self) -> None:
        """Count one optimizer step (``stats()`` reports per-step averages)."""
        self.steps += 1
        if self.reducer is not None:
            self.reducer.count_step()

    def stats(self) -> Dict[str, Any]:
        """Bytes of gradient payload sent and received, per step and in total.

        With a compressor: :meth:`CompressedReducer.stats`.  Without: the
        bytes this rank put into all-reduces and all-gathers (nothing on one
        rank), ``ratio_to_fp32`` 1.
        """
        if self.reducer is not None or self.adasum is not None:
            return (self.reducer or self.adasum).stats()
        per_step = self._sent / max(1, self.steps)
        return {"compressor": None, "steps": self.steps, "sent_bytes": self._sent, "sent_bytes_per_step": per_step,
                "received_bytes_per_step": per_step, "dense_bytes_per_step": per_step, "ratio_to_fp32": 1.0}


def no_rows(dense_shape: Sequence[int], dtype: Any) -> Tuple[np.ndarray, np.ndarray]:
    """The rows of a rank that has no sparse gradient for a tensor: none, in the right trailing shape."""
    return np.zeros(0, dtype=np.int64), np.zeros((0,) + tuple(dense_shape[1:]), dtype=dtype)
