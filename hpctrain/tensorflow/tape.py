"""DistributedGradientTape: a GradientTape whose gradients are averaged over ranks."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..collectives.ops import check_gradient_reduction
from .ops import reduce_gradients

__all__ = ["DistributedGradientTape"]


class DistributedGradientTape:
    """Wrap a ``tf.GradientTape`` so that ``gradient()`` returns gradients reduced over ranks.

    Use it as Horovod's::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hpctrain.tensorflow.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    or ``with DistributedGradientTape(tf.GradientTape()) as tape:``.  Works
    eagerly and inside ``tf.function`` (see :mod:`hpctrain.tensorflow.ops` for
    what that costs).  Everything else (``watch``, ``jacobian``, ...) is the
    wrapped tape's.

    Formula: ``g = (1/N) sum_r g_r`` for ``op="avg"`` (``sum`` without 1/N).
    Cost: one fused all-reduce of all dense gradients after the tape has
    computed them (TensorFlow gives a tape's gradients all at once, so
    communication cannot overlap backward here as it does in
    :class:`hpctrain.torch.DistributedOptimizer`); see
    :func:`~hpctrain.tensorflow.ops.reduce_gradients` for sparse gradients.

    Args:
        tape: the ``tf.GradientTape``.
        compression: reserved for gradient compressors; only ``None`` today.
        op: ``"avg"`` (default) or ``"sum"``.
        sparse_as_dense: densify ``IndexedSlices`` gradients before reducing.
        comm: the communicator (default: the world).
    """

    def __init__(self, tape: tf.GradientTape, compression=None, op: str = "avg", sparse_as_dense: bool = False,
                 comm=None):
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}")
        check_gradient_reduction(op, compression)
        self._tape, self._op, self._sparse_as_dense, self._comm = tape, op, sparse_as_dense, comm

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE) -> Any:
        """Return ``tape.gradient(...)`` reduced over ranks, in the structure of ``sources``."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, op=self._op, comm=self._comm, sparse_as_dense=self._sparse_as_dense)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)
