"""Horovod's ``hvd.SyncBatchNormalization``: Keras batch normalization with statistics over every rank's batch.

During training the mean and variance are those of the global batch (all
ranks' samples of the process set), computed in two passes: the sum and
count of the inputs, all-reduced, give the mean; the sum of squared
deviations from it, all-reduced, gives the variance, so the result equals
``BatchNormalization`` on the concatenated batch (and the moving statistics
follow it).  Gradients flow through both all-reduces.  Cost per layer and
step: two small all-reduces of the per-channel sums.  Inference uses the
moving statistics, as usual.  Works with Keras 3 and with Keras 2
(``tf-keras``); masks are not supported.
"""
from __future__ import annotations

import inspect

import tensorflow as tf

from ..basics import Sum, global_process_set
from .mpi_ops import _grouped_allreduce

__all__ = ["sync_batch_norm_class", "global_moments"]

_DOC = __doc__


def global_moments(x: tf.Tensor, axes, keepdims: bool, process_set=global_process_set):
    """Return the mean and (biased) variance of ``x`` over ``axes`` and over every rank of the set."""
    work = tf.float32 if x.dtype in (tf.float16, tf.bfloat16) else x.dtype
    x = tf.cast(x, work)
    axes = list(axes)
    count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), work)
    total, n = _grouped_allreduce([tf.reduce_sum(x, axes, keepdims=True), tf.reshape(count, [1])], op=Sum,
                                  process_set=process_set)
    mean = total / n[0]
    (squares,) = _grouped_allreduce([tf.reduce_sum(tf.square(x - mean), axes, keepdims=True)], op=Sum,
                                    process_set=process_set)
    variance = squares / n[0]
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def sync_batch_norm_class(base: type, module: str) -> type:
    """Return ``SyncBatchNormalization`` on the Keras ``BatchNormalization`` class ``base``."""

    def __init__(self, *args, process_set=global_process_set, **kwargs):
        if "fused" in inspect.signature(base.__init__).parameters:   # Keras 2: the fused kernel skips the hook
            kwargs["fused"] = False
        base.__init__(self, *args, **kwargs)
        self._hpctrain_set = process_set

    def _moments(self, inputs, mask):                                 # Keras 3
        if mask is not None:
            raise NotImplementedError("SyncBatchNormalization does not take a mask")
        return global_moments(inputs, self._reduction_axes, False, self._hpctrain_set)

    def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):   # Keras 2
        if mask is not None:
            raise NotImplementedError("SyncBatchNormalization does not take a mask")
        return global_moments(inputs, reduction_axes, keep_dims, self._hpctrain_set)

    hook = ("_calculate_mean_and_var", _calculate_mean_and_var) if hasattr(base, "_calculate_mean_and_var") \
        else ("_moments", _moments)
    SyncBatchNormalization = type("SyncBatchNormalization", (base,), {"__init__": __init__, hook[0]: hook[1]})
    SyncBatchNormalization.__doc__ = _DOC
    SyncBatchNormalization.__module__ = module
    SyncBatchNormalization.__qualname__ = "SyncBatchNormalization"
    return SyncBatchNormalization
