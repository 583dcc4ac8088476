"""Horovod's public TensorFlow reductions: ``hvd.allreduce``, ``grouped_allreduce``, ``reducescatter``.

They add to the ops of :mod:`.mpi_ops` what Horovod's public functions add:
the default op Average (``average=`` still accepted), ``compression=`` around
the wire tensor, and ``tf.IndexedSlices``: a sparse gradient is reduced by
gathering every rank's values and indices (values divided by the set's size
for Average), which an optimizer's scatter-add turns into the reduced dense
gradient.  Cost of the sparse form: each rank receives every rank's rows.
``device_dense``/``device_sparse`` are accepted and ignored (tensors are
staged through host memory).
"""
from __future__ import annotations

from typing import List, Optional

import tensorflow as tf

from .. import basics
from ..basics import Adasum, Average, Sum, global_process_set
from ..requests import set_size
from .compression import Compression
from .mpi_ops import _allreduce, _grouped_allreduce, _grouped_reducescatter, _reducescatter, grouped_allgather

__all__ = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter"]


_plain = tf.autograph.experimental.do_not_convert     # plain Python: AutoGraph need not rewrite it


def _resolve(op, average):
    """Horovod's op from ``op``/``average`` (default Average), as its integer constant."""
    name = basics.op_name(op, average)
    return {"avg": Average, "sum": Sum, "adasum": Adasum}.get(name, op)


def _check_sparse(op, prescale_factor, postscale_factor) -> None:
    if op == Adasum:
        raise NotImplementedError("Adasum does not reduce tf.IndexedSlices; pass sparse_as_dense=True to the "
                                  "optimizer or tape, or convert the gradient with tf.convert_to_tensor")
    if op not in (Sum, Average):
        raise NotImplementedError("only Sum and Average reduce tf.IndexedSlices (they are gathered, not reduced)")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("prescale_factor/postscale_factor do not apply to tf.IndexedSlices")


def _gathered_slices(slices: List[tf.IndexedSlices], op, process_set) -> List[tf.IndexedSlices]:
    values = grouped_allgather([s.values for s in slices], process_set=process_set)
    indices = grouped_allgather([s.indices for s in slices], process_set=process_set)
    n = set_size(process_set)
    return [tf.IndexedSlices(v / tf.cast(n, v.dtype) if op == Average else v, i, dense_shape=s.dense_shape)
            for v, i, s in zip(values, indices, slices)]


@_plain
def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name: Optional[str] = None,
              process_set=global_process_set, ignore_name_scope=False):
    """Return ``tensor`` (tf.Tensor, tf.Variable or tf.IndexedSlices) reduced over the set; default op Average.

    Differentiable for dense tensors.  ``compression``: Horovod's
    ``Compression.none``/``fp16`` around the wire tensor.
    """
    op = _resolve(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(op, prescale_factor, postscale_factor)
        return _gathered_slices([tensor], op, process_set)[0]
    wire, ctx = compression.compress(tensor)
    out = _allreduce(wire, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                     process_set=process_set)
    return compression.decompress(out, ctx)


@_plain
def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name: Optional[str] = None):
    """Return each of ``tensors`` reduced over the set: dense ones in one fused request, IndexedSlices gathered."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    op = _resolve(op, average)
    out: list = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i in range(len(tensors)) if i not in sparse]
    if sparse:
        _check_sparse(op, prescale_factor, postscale_factor)
        for i, s in zip(sparse, _gathered_slices([tensors[i] for i in sparse], op, process_set)):
            out[i] = s
    if dense:
        pairs = [compression.compress(tensors[i]) for i in dense]
        reduced = _grouped_allreduce([w for w, _ in pairs], name=name, op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, process_set=process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


@_plain
def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name: Optional[str] = None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Return this rank's block of dim 0 of the reduction of ``tensor`` (default op Average); differentiable."""
    wire, ctx = compression.compress(tensor)
    out = _reducescatter(wire, name=name, op=op, process_set=process_set, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor)
    return compression.decompress(out, ctx)


@_plain
def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Return the reduce-scatter of each of ``tensors`` (one request, default op Average); differentiable."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    pairs = [compression.compress(t) for t in tensors]
    outs = _grouped_reducescatter([w for w, _ in pairs], op=op, process_set=process_set,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
