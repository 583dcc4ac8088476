"""Keras 3 (TensorFlow backend) data parallelism: a distributed optimizer and the usual callbacks.

Four lines turn a single-process Keras script into a data-parallel one::

    import hpctrain, hpctrain.tensorflow.keras as hk
    hpctrain.init()
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(1e-3 * hpctrain.size())), ...)
    model.fit(dataset, callbacks=[hk.BroadcastGlobalVariablesCallback(0), hk.MetricAverageCallback()],
              verbose=1 if hpctrain.rank() == 0 else 0)

with :func:`hpctrain.tensorflow.distributed_dataset` giving each rank its share.
``model.fit`` runs its train step inside ``tf.function``; the gradient
all-reduce is one graph op there (see :mod:`hpctrain.tensorflow.ops`).  Keras
compiles with XLA by default on GPUs, which cannot run that op: pass
``jit_compile=False`` to ``model.compile`` (on CPUs Keras does not use XLA).
"""
from __future__ import annotations

import sys
from typing import Dict, Optional

import keras

from ..gradients import GradientAverager
from ..metrics import average_metrics
from ..world import comm_or_world
from .ops import average_gradients, broadcast_variables
from .tape import _name

__all__ = ["DistributedOptimizer", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateWarmupCallback"]

_CLASSES: Dict[type, type] = {}


class _DistributedMixin:
    """Reduces the gradients over ranks in ``apply`` (which ``apply_gradients`` and ``model.fit`` call)."""

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        averager = self._hpctrain
        names = None
        if averager.compressor is not None:
            variables = trainable_variables if trainable_variables is not None else self._trainable_variables
            names = [_name(v, i) for i, v in enumerate(variables)]
        return super().apply(average_gradients(averager, grads, names), trainable_variables)

    def compression_stats(self) -> dict:
        """Bytes of gradient payload sent and received, per step and in total (:meth:`GradientAverager.stats`)."""
        return self._hpctrain.stats()


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, compression=None, op: str = "avg",
                         sparse_as_dense: bool = False, comm=None,
                         compression_policy=None) -> keras.optimizers.Optimizer:
    """Make a Keras 3 optimizer average its gradients over ranks before every update.

    The optimizer object itself is returned with its class changed to a
    subclass of its own (``isinstance``, ``get_config``, learning-rate
    schedules, ``gradient_accumulation_steps`` and checkpoints of its
    variables keep working).  Gradients are reduced by
    :func:`hpctrain.tensorflow.reduce_gradients`: one fused all-reduce per step
    after backward (Keras computes all gradients before ``apply``).

    Formula: ``g = (1/N) sum_r g_r`` (``op="avg"``) or the plain sum.  With
    ``gradient_accumulation_steps=k`` the all-reduce runs on every
    micro-batch (correct, k times the traffic).

    Args:
        optimizer: any ``keras.optimizers.Optimizer``.
        compression: a compressor of :mod:`hpctrain.compression` (or its
            name); gradients are named by their variables' paths.
        op: ``"avg"`` or ``"sum"``.
        sparse_as_dense: densify ``IndexedSlices`` gradients before reducing
            (the sparse policy: :mod:`hpctrain.gradients`).
        comm: the communicator (default: the world).
        compression_policy: which gradients are compressed (default
            :class:`hpctrain.compression.Policy`).
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    averager = GradientAverager(comm, op, compression, compression_policy, sparse_as_dense)
    cls = type(optimizer)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Distributed{cls.__name__}", (_DistributedMixin, cls), {"__module__": __name__})
    optimizer.__class__ = _CLASSES[cls]
    optimizer._hpctrain = averager
    return optimizer


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, copy rank ``root``'s model (and optimizer) variables to every rank.

    Replicas initialised with different seeds, or one rank restored from a
    checkpoint, start equal.  Optimizer variables are broadcast too once the
    optimizer is built (Keras builds it before training starts; if not, after
    the first step).  Cost: one broadcast per dtype of all variables, once.
    """

    def __init__(self, root: int = 0, comm=None):
        super().__init__()
        self.root, self.comm, self._optimizer_done = root, comm, False

    def _broadcast_optimizer(self) -> None:
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and opt.built:
            broadcast_variables(opt.variables, self.root, self.comm)
            self._optimizer_done = True

    def on_train_begin(self, logs=None):
        broadcast_variables(self.model.variables, self.root, self.comm)
        self._optimizer_done = False
        self._broadcast_optimizer()

    def on_train_batch_end(self, batch, logs=None):
        if not self._optimizer_done:
            self._broadcast_optimizer()


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of every epoch, replace each logged metric by its mean over ranks.

    Put it first in ``callbacks`` so that the callbacks after it (checkpoint,
    early stopping, CSV logger) see the averaged values.  Cost: one
    all-reduce of the scalars per epoch.
    """

    def __init__(self, comm=None):
        super().__init__()
        self.comm = comm

    def on_epoch_end(self, epoch, logs=None):
        if logs:
            scalars = {k: v for k, v in logs.items() if _is_scalar(v)}
            logs.update(average_metrics(scalars, self.comm))


def _is_scalar(v) -> bool:
    shape = getattr(v, "shape", ())
    return isinstance(v, (int, float)) or (shape is not None and len(shape) == 0 and hasattr(v, "dtype"))


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / N`` to ``initial_lr`` over the first epochs.

    Large data-parallel batches train with the learning rate scaled by N
    (Goyal et al. 2017, "Accurate, Large Minibatch SGD"); starting at the
    single-process rate and ramping up avoids early divergence.  At epoch
    progress ``e = epoch + batch / steps_per_epoch < warmup_epochs``:
    ``lr = initial_lr / N * (e (N - 1) / warmup_epochs + 1)``; from then on
    ``initial_lr`` (Horovod's callback uses the same formula).

    Args:
        initial_lr: the target rate (already scaled by N).
        warmup_epochs: length of the ramp in epochs.
        steps_per_epoch: batches per epoch; default: what ``fit`` reports
            (required when the dataset's length is unknown).
        verbose: rank 0 prints when the warm-up ends.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0, comm=None):
        super().__init__()
        if initial_lr <= 0 or warmup_epochs <= 0:
            raise ValueError(f"initial_lr and warmup_epochs must be > 0, got {initial_lr}, {warmup_epochs}")
        self.initial_lr, self.warmup_epochs = float(initial_lr), float(warmup_epochs)
        self.steps_per_epoch, self.verbose, self.comm = steps_per_epoch, verbose, comm
        self._epoch, self._done = 0, False

    def learning_rate(self, progress: float) -> float:
        """The rate at epoch progress ``progress`` (epochs, fractional)."""
        n = comm_or_world(self.comm).size
        if progress >= self.warmup_epochs:
            return self.initial_lr
        return self.initial_lr / n * (progress * (n - 1) / self.warmup_epochs + 1)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError("LearningRateWarmupCallback needs steps_per_epoch: the dataset's length is unknown")

    def on_train_batch_begin(self, batch, logs=None):
        progress = self._epoch + batch / self.steps_per_epoch
        if progress < self.warmup_epochs or not self._done:
            self.model.optimizer.learning_rate = self.learning_rate(progress)
            self._done = progress >= self.warmup_epochs
            if self._done and self.verbose and comm_or_world(self.comm).rank == 0:
                print(f"epoch {self._epoch}: learning-rate warm-up done, rate {self.initial_lr:g}", file=sys.stderr)
