"""Local gradient aggregation over ``k`` backward passes for Keras: one reduction and one update per ``k`` passes.

Formula: ``G = sum_{p=1..k} g_p`` (divided by ``k`` when averaging), reduced
over the ranks and applied on every ``k``-th pass; the other passes only add.
Cost: one reduction per ``k`` passes; memory: one dense sum per trainable
variable.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import tensorflow as tf

from .tape import var_key

__all__ = ["Aggregation"]


class Aggregation:
    """Local accumulation over ``k`` backward passes (``counter`` counts the passes of the current round)."""

    def __init__(self, k: int, average: bool):
        self.k, self.average = k, average
        self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hpctrain_agg_counter")
        self._sums: dict = {}

    def add(self, grads: Sequence[Any], variables: Sequence[Any]) -> None:
        """Add this pass's gradients to the sums (created zero on first use, outside any graph)."""
        for g, v in zip(grads, variables):
            key = var_key(v)
            if key not in self._sums:
                with tf.init_scope():
                    self._sums[key] = tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                                  name="hpctrain_agg_sum")
            if g is not None:
                self._sums[key].assign_add(tf.convert_to_tensor(g))
        self.counter.assign_add(1)

    def totals(self, variables: Sequence[Any]) -> List[tf.Tensor]:
        """The sums (divided by k when averaging) of ``variables``' gradients."""
        out = []
        for v in variables:
            s = self._sums[var_key(v)].read_value()
            out.append(s / tf.cast(self.k, s.dtype) if self.average else s)
        return out

    def reset(self) -> None:
        """Start a new round: sums and counter back to zero."""
        for s in self._sums.values():
            s.assign(tf.zeros_like(s))
        self.counter.assign(0)
