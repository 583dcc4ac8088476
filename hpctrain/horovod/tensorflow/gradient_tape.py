"""Horovod's ``hvd.DistributedGradientTape`` and ``PartialDistributedGradientTape`` on hpctrain's tape.

The tape is :class:`hpctrain.tensorflow.DistributedGradientTape` (one fused
all-reduce of the dense gradients, sparse ``IndexedSlices`` gathered as
rows, hpctrain's compressors with error feedback) over a
:class:`~hpctrain.horovod.negotiated.NegotiatedComm`, so its reduction is
negotiated like every other Horovod request.  Horovod's arguments map as
:mod:`hpctrain.horovod.gradient_args` says; ``num_groups``/``groups`` are
accepted and change nothing (TensorFlow hands over a step's gradients at
once, and they are reduced in one fused request).

Local sources (``register_local_source``, ``local_layers=``): see
:mod:`hpctrain.horovod.local_gradients`.  A rank outside the process set
reduces over a world of its own, so it gets its own gradients.
"""
from __future__ import annotations

from typing import Any, List

import tensorflow as tf

from ...tensorflow.tape import DistributedGradientTape as _NativeTape
from ...tensorflow.tape import var_key
from ..basics import Average, global_process_set
from ..gradient_args import gradient_settings
from ..requests import set_size
from .compression import Compression
from ..local_gradients import reduce_partial

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _HorovodTape(_NativeTape):
    """hpctrain's tape with Horovod's local sources."""

    def __init__(self, tape, comm, compression, op, sparse_as_dense, process_set, scale_local_gradients):
        super().__init__(tape, compression=compression, op=op, sparse_as_dense=sparse_as_dense, comm=comm)
        self._process_set, self._scale_local = process_set, scale_local_gradients
        self._local_sources = set()

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank (not reduced; divided by the set's size when scaling)."""
        self._local_sources.add(var_key(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False,
                 unconnected_gradients=tf.UnconnectedGradients.NONE) -> Any:
        """Return the gradients of ``target`` with respect to ``sources``, the global ones reduced over the set."""
        flat = tf.nest.flatten(sources, expand_composites=False)
        grads = self._tape.gradient(target, flat, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        grads = reduce_partial(self._averager, grads, flat, self._local_sources, set_size(self._process_set),
                               self._scale_local)
        return tf.nest.pack_sequence_as(sources, grads, expand_composites=False)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """Return ``([(local source, gradient)], [(global source, reduced gradient)])``."""
        grads = self.gradient(target, sources, output_gradients)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if var_key(s) in self._local_sources else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                            sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                            groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Wrap ``gradtape`` so that ``gradient()`` returns gradients averaged (or summed) over the set's ranks.

    ``with hvd.DistributedGradientTape(tf.GradientTape()) as tape:`` works
    too.  A rank outside ``process_set`` gets its own gradients.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    s = gradient_settings(compression, op, gradient_predivide_factor, process_set)
    return _HorovodTape(gradtape, s.comm, s.compressor, s.op, sparse_as_dense, process_set, scale_local_gradients)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=Compression.none,
                                   sparse_as_dense=False, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set, local_layers=None,
                                   scale_local_gradients=True):
    """A :func:`DistributedGradientTape` whose ``local_layers`` (Keras layers) keep their gradients local."""
    layers: List[Any] = [] if local_layers is None else (
        list(local_layers) if isinstance(local_layers, (list, tuple, set)) else [local_layers])
    bad = [type(layer).__name__ for layer in layers if not hasattr(layer, "trainable_weights")]
    if bad:
        raise ValueError(f"local_layers must be Keras layers, got {bad}")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
