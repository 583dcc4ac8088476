"""Horovod's ``hvd.DistributedOptimizer`` for TensorFlow: Keras optimizers and ``tf.compat.v1.train`` ones.

A Keras optimizer (Keras 3, or Keras 2 from ``tf-keras``) is wrapped as
``hpctrain.horovod.tensorflow.keras.DistributedOptimizer`` does
(:mod:`hpctrain.horovod.keras_optimizer`).  A TF1 ``tf.compat.v1.train.Optimizer``
gets a subclass of its own class whose ``compute_gradients`` returns the
gradients reduced over the process set (one fused request per step, sparse
``IndexedSlices`` gathered); ``backward_passes_per_step > 1`` is refused
there (use a Keras optimizer).
"""
from __future__ import annotations

import tensorflow as tf

from ..basics import Average, global_process_set
from ..gradient_args import gradient_settings
from ..keras_optimizer import wrap_optimizer
from .compression import Compression

__all__ = ["DistributedOptimizer"]


class _V1Distributed:
    """Mixin for ``tf.compat.v1.train.Optimizer`` subclasses: reduce in ``compute_gradients`` (Adasum: combine
    the variables' deltas in ``apply_gradients``)."""

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        settings, _ = self._hpctrain_config
        if settings.op != "adasum":
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        from ...adasum_updates import AdasumUpdates
        from ...tensorflow.adasum_apply import apply_with_adasum
        if not hasattr(self, "_hpctrain_adasum"):
            self._hpctrain_adasum = AdasumUpdates(settings.comm, settings.compressor)
        pairs = list(grads_and_vars)
        parent = super()
        return apply_with_adasum(self._hpctrain_adasum, [v for g, v in pairs if g is not None],
                                 lambda: parent.apply_gradients(pairs, *args, **kwargs))

    def compute_gradients(self, *args, **kwargs):
        from ...gradients import GradientAverager
        from ...tensorflow.ops import average_gradients
        pairs = super().compute_gradients(*args, **kwargs)
        settings, sparse_as_dense = self._hpctrain_config
        if settings.op == "adasum":
            return pairs
        if not hasattr(self, "_hpctrain_averager"):
            self._hpctrain_averager = GradientAverager(settings.comm, settings.op, settings.compressor,
                                                       sparse_as_dense=sparse_as_dense)
        grads = average_gradients(self._hpctrain_averager, [g for g, _ in pairs])
        return [(g, v) for g, (_, v) in zip(grads, pairs)]


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="", device_sparse="",
                         compression=Compression.none, sparse_as_dense=False, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=global_process_set, scale_local_gradients=True):
    """Make ``optimizer`` reduce its gradients over the process set (default: average over all ranks)."""
    settings = gradient_settings(compression, op, gradient_predivide_factor, process_set)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise ValueError("backward_passes_per_step > 1 needs a Keras optimizer here, not a tf.compat.v1 one")
        base = type(optimizer)
        cls = type(base.__name__, (_V1Distributed, base), {"__module__": __name__,
                                                           "_hpctrain_config": (settings, bool(sparse_as_dense))})
        optimizer.__class__ = cls
        return optimizer
    if not hasattr(optimizer, "get_config"):
        raise TypeError(f"DistributedOptimizer wraps a Keras or tf.compat.v1.train optimizer, got "
                        f"{type(optimizer).__name__}")
    return wrap_optimizer(optimizer, settings, process_set, sparse_as_dense, backward_passes_per_step,
                          average_aggregated_gradients, scale_local_gradients)
