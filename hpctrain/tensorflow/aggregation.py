"""Local gradient aggregation over ``k`` backward passes for Keras: one reduction and one update per ``k`` passes.

Formula: ``G = sum_{p=1..k} g_p`` (divided by ``k`` when averaging), reduced
over the ranks and applied on every ``k``-th pass; the other passes only add.
What the passes between do is the caller's: Horovod's optimizer counts them
in ``iterations`` (as Horovod does), the native one does not (``iterations``
counts updates, as Keras's own ``gradient_accumulation_steps`` reports it).
Cost: one reduction per ``k`` passes; memory: one dense sum per trainable
variable.  Used by :func:`hpctrain.tensorflow.keras.DistributedOptimizer`
and by Horovod's Keras optimizer in :mod:`hpctrain.horovod`.
"""
from __future__ import annotations

from typing import Any, Callable, List, Sequence

import tensorflow as tf

from .tape import var_key

__all__ = ["Aggregation"]


def _plain_variable(shape, dtype, name: str) -> tf.Variable:
    return tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)


class Aggregation:
    """Local accumulation over ``k`` backward passes (``counter`` counts the passes of the current round).

    ``make(shape, dtype, name)`` creates the counter and the sums (zero):
    plain ``tf.Variable``s by default, the optimizer's own variables in the
    native adapter (so that checkpoints and elastic commits hold a round
    half-way through).
    """

    def __init__(self, k: int, average: bool, make: Callable[..., Any] = _plain_variable):
        self.k, self.average, self._make = k, average, make
        self.counter = None
        self._sums: dict = {}

    def build(self, variables: Sequence[Any]) -> None:
        """Create the counter and a zero sum for each of ``variables`` not yet summed (outside any graph)."""
        with tf.init_scope():
            if self.counter is None:
                self.counter = self._make((), tf.int64, "hpctrain_agg_counter")
            for v in variables:
                if var_key(v) not in self._sums:
                    self._sums[var_key(v)] = self._make(v.shape, v.dtype, "hpctrain_agg_sum")

    @property
    def variables(self) -> List[Any]:
        """The counter and the sums: each rank's own (never broadcast or averaged)."""
        return ([] if self.counter is None else [self.counter]) + list(self._sums.values())

    def add(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """Add this pass's gradients to the sums (created zero on first use)."""
        self.build(variables)
        for g, v in zip(grads, variables):
            if g is not None:
                self._sums[var_key(v)].assign_add(tf.convert_to_tensor(g))
        self.counter.assign_add(1)

    def totals(self, variables: Sequence[Any]) -> List[tf.Tensor]:
        """The sums (divided by k when averaging) of ``variables``' gradients."""
        out = []
        for v in variables:
            s = tf.identity(tf.convert_to_tensor(self._sums[var_key(v)]))
            out.append(s / tf.cast(self.k, s.dtype) if self.average else s)
        return out

    def reset(self) -> None:
        """Start a new round: sums and counter back to zero."""
        for s in self._sums.values():
            s.assign(tf.zeros(s.shape, s.dtype))
        self.counter.assign(0)

    def step(self, grads: Sequence[Any], variables: Sequence[Any], reduce_and_apply: Callable[[List[Any]], Any],
             count_pass: Callable[[], Any]) -> tf.Tensor:
        """Add ``grads``; on every ``k``-th pass ``reduce_and_apply(totals)`` and start a new round, on the others
        ``count_pass()``.  Returns whether this pass applied (a boolean tensor; a ``tf.cond`` in a graph)."""
        self.add(grads, variables)

        def apply_now():
            reduce_and_apply(self.totals(variables))
            self.reset()
            return tf.constant(True)

        def count_only():
            count_pass()
            return tf.constant(False)
        return tf.cond(self.counter >= self.k, apply_now, count_only)
