"""DistributedGradientTape: a GradientTape whose gradients are averaged over ranks."""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..gradients import GradientAverager
from .ops import CurrentAverager, average_gradients, follow_the_world

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
        compression: a compressor of :mod:`hpctrain.compression` (or its
            name); gradients are named by their variables' paths.
        op: ``"avg"`` (default) or ``"sum"``.
        sparse_as_dense: densify ``IndexedSlices`` gradients before reducing
            (the sparse policy: :mod:`hpctrain.gradients`).
        comm: the communicator (default: the world).
        compression_policy: which gradients are compressed (default
            :class:`hpctrain.compression.Policy`).
    """

    def __init__(self, tape: tf.GradientTape, compression=None, op: str = "avg", sparse_as_dense: bool = False,
                 comm=None, compression_policy=None):
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}")
        self._tape = tape
        self._hpctrain = GradientAverager(comm, op, compression, compression_policy, sparse_as_dense)
        self._averager = CurrentAverager(self)      # (a step traced once follows a re-formed world: elastic mode)
        if comm is None:
            follow_the_world(self, op, compression, compression_policy, sparse_as_dense)

    def compression_stats(self) -> dict:
        """Bytes of gradient payload sent and received, per step and in total (:meth:`GradientAverager.stats`)."""
        return self._averager.stats()

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE) -> Any:
        """Return ``tape.gradient(...)`` reduced over ranks, in the structure of ``sources``."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        reduced = self._reduce(tf.nest.flatten(grads, expand_composites=False),
                               tf.nest.flatten(sources, expand_composites=False))
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    def _reduce(self, grads: list, sources: list) -> list:
        """Reduce the flat ``grads`` of the flat ``sources`` (which name them for a compressor)."""
        names = [_name(v, i) for i, v in enumerate(sources)] if self._averager.compressor is not None else None
        return average_gradients(self._averager, grads, names)

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc) -> Any:
        return self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


def _name(variable, i: int) -> str:
    """A variable's path (Keras 3) or name, else its position; used to key compressor state."""
    return str(getattr(variable, "path", None) or getattr(variable, "name", None) or f"grad{i}")


def var_key(variable):
    """A hashable key for a variable: ``ref()`` of a tf.Variable, the object's id for a Keras 3 variable."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)
