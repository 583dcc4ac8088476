"""Local SGD and DiLoCo for Keras 3: the rule of :mod:`hpctrain.optim.local_sgd` inside the optimizer's ``apply``.

Each step, inside the step ``fit`` traces: one small graph op asks the core
whether the step is synchronous (warm-up: the gradients are averaged, else
they stay local); after the update another tells the core a step was done,
and on the steps it names (an outer step, the warm-up's end) the trainable
variables go to the core as one flat array and come back from it.

The optimizer's state spans the ranks, as the torch adapter's does: a
checkpoint writes each rank's trainable variables and optimizer variables with
the core's state (``shard_state_dict``) and restores them at any world size
(``load_shard_state_dict``; the rule: :meth:`hpctrain.optim.local_sgd.LocalSGD.load_saved`).
"""
from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from ..gradients import GradientAverager
from ..optim.local_sgd import LOCAL_SGD_FORMAT, LocalSGD, OuterNesterov
from .ops import average_gradients, host_call, swap_class

__all__ = ["LocalSGDOptimizer"]

def LocalSGDOptimizer(optimizer: keras.optimizers.Optimizer, sync_every: int = 16, warmup_steps: int = 0,
                      outer_lr: Optional[float] = None, outer_momentum: float = 0.9, compression=None,
                      comm=None) -> keras.optimizers.Optimizer:
    """Make a Keras optimizer train with local SGD, or DiLoCo with ``outer_lr`` (the torch adapter's arguments).

    The optimizer object is returned with its class swapped for a subclass of
    its own; the core is ``optimizer.local_sgd``.  The model's variables must
    be alike on every rank before the first step (the same seed, or
    :class:`~hpctrain.tensorflow.keras.BroadcastGlobalVariablesCallback`) and
    of one dtype.  Rule and cost: :mod:`hpctrain.optim.local_sgd`.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"LocalSGDOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _LocalSGDMixin):
        raise ValueError("this optimizer is already a LocalSGDOptimizer")
    outer = OuterNesterov(outer_lr, outer_momentum) if outer_lr is not None else None
    local = LocalSGD(comm, sync_every, warmup_steps, outer, compression)
    swap_class(optimizer, _LocalSGDMixin, "LocalSGD")
    optimizer.local_sgd = local
    optimizer._hpctrain_local_averager = GradientAverager(local.comm, "avg")
    return optimizer


class _LocalSGDMixin:
    """Averages the gradients during the warm-up only; hands the variables to the core on its steps."""

    local_sgd: LocalSGD
    hpctrain_state_spans_ranks = True
    hpctrain_state_format = LOCAL_SGD_FORMAT

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Nothing to gather (the torch adapter's API): a checkpoint takes each rank's part."""

    def _trained(self) -> list:
        trained = list(getattr(self, "_trainable_variables", None) or [])
        if not trained:
            raise ValueError("a LocalSGDOptimizer is saved and restored once built: call "
                             "optimizer.build(model.trainable_variables) first")
        return trained

    def shard_state_dict(self) -> tuple:
        """``(common, own)``: the global copy, outer momentum and counters; this rank's trainable variables (flat),
        optimizer variables and step counts."""
        trained = self._trained()
        common = {"format": LOCAL_SGD_FORMAT, "world": self.local_sgd.comm.size, "core": self.local_sgd.common_state()}
        own = {"core": self.local_sgd.own_state(), "variables": [np.asarray(v.numpy()) for v in self.variables],
               "params": np.concatenate([np.asarray(v.numpy()).reshape(-1) for v in trained])}
        return common, own

    def load_shard_state_dict(self, common: dict, read) -> None:
        """Go on from a state written by :meth:`shard_state_dict` at any world size (``read(rank)``: that rank's
        ``own``)."""
        trained = self._trained()
        mine, own = self.local_sgd.load_saved(common, read)
        if len(own["variables"]) != len(self.variables):
            raise ValueError(f"the checkpoint has {len(own['variables'])} optimizer variables, this optimizer "
                             f"{len(self.variables)}")
        for v, value in zip(self.variables, own["variables"]):
            v.assign(np.asarray(value))
        offset = 0
        for v in trained:
            n = int(np.prod(v.shape))
            v.assign(np.asarray(mine[offset:offset + n]).reshape(tuple(v.shape)))
            offset += n

    def apply(self, grads, trainable_variables=None):
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        dtypes = {v.dtype for v in variables}
        if len(dtypes) != 1:
            raise ValueError(f"LocalSGDOptimizer needs trainable variables of one dtype, got {sorted(map(str, dtypes))}")
        grads = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
        local, averager = self.local_sgd, self._hpctrain_local_averager
        dtype = variables[0].dtype

        def flat():
            return tf.concat([tf.reshape(v, [-1]) for v in variables], 0)

        def start():        # (before the first step: the global copy is the variables as they start)
            (done,) = host_call(lambda values: [np.array(local.start(values) is None)], [flat()], [tf.bool],
                                "local_sgd_start")
            return done

        # one op asks the core: bit 1, the global copy is not taken yet; bit 0, this step averages its gradients
        (phase,) = host_call(lambda: [np.array(2 * (local.theta_g is None) + local.synchronous, np.int32)], [],
                             [tf.int32], "local_sgd_phase")
        tf.cond(phase >= 2, start, lambda: tf.constant(False))
        grads = tf.cond(phase % 2 == 1, lambda: average_gradients(averager, grads),
                        lambda: [tf.identity(g) for g in grads])
        result = super().apply(grads, trainable_variables)
        (todo,) = host_call(lambda: [np.array(local.step_done(), np.int32)], [], [tf.int32], "local_sgd_step")

        def exchange():
            def run(code, values):
                values = np.array(values, copy=True)
                local.after_step(int(code), values)
                return [values]
            (new,) = host_call(run, [todo, flat()], [dtype], "local_sgd_sync")
            offset = 0
            for v in variables:
                n = int(np.prod(v.shape))
                v.assign(tf.reshape(new[offset:offset + n], v.shape))
                offset += n
            return tf.constant(True)

        tf.cond(todo > 0, exchange, lambda: tf.constant(False))
        return result
