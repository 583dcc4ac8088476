"""What the data-parallel Keras callbacks do, apart from which Keras they belong to.

Keras 3 (``keras``) and Keras 2 (``tf-keras``, ``TF_USE_LEGACY_KERAS=1``)
each insist on callbacks derived from their own ``Callback`` class.  The
behaviour lives here once, as mixins; :mod:`hpctrain.tensorflow.keras`
combines them with Keras 3's class, :mod:`hpctrain.horovod.keras_api` with
whichever Keras the user's module uses.  The
mixins reach the ranks through ``self.comm`` (a communicator, or None for
the world).
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Union

from ..metrics import average_metrics
from ..world import comm_or_world

__all__ = ["BroadcastMixin", "MetricAverageMixin", "LearningRateScheduleMixin", "LearningRateWarmupMixin",
           "set_learning_rate", "get_learning_rate"]


def get_learning_rate(optimizer) -> float:
    """The optimizer's current learning rate as a float (Keras 3, Keras 2 and legacy optimizers)."""
    lr = getattr(optimizer, "learning_rate", None)
    if lr is None:
        lr = optimizer.lr
    return float(lr.numpy() if hasattr(lr, "numpy") else lr)


def set_learning_rate(optimizer, value: float) -> None:
    """Set the optimizer's learning rate in place (its variable is assigned where it has one)."""
    lr = getattr(optimizer, "learning_rate", None)
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value


class BroadcastMixin:
    """At the start of training, copy rank ``root``'s model (and optimizer) variables to every rank.

    Optimizer variables follow once the optimizer is built (before training
    starts, or after the first step); so do the model's when it has no input
    shape before its first step (Keras 2 builds such models then), as with
    Horovod's callback.  An optimizer's ``hpctrain_rank_local_variables``
    (the partial sums of ``backward_passes_per_step``) are not broadcast.
    ``local_variables`` (keys of
    :func:`hpctrain.tensorflow.tape.var_key`) keep each rank's own values.  Cost: one broadcast per dtype of all
    variables, once.  ``broadcast(variables, root)`` is the framework's.
    """

    root: int = 0
    local_variables: frozenset = frozenset()

    def broadcast(self, variables, root: int) -> None:
        from .ops import broadcast_variables
        from .tape import var_key
        shared = [v for v in variables if var_key(v) not in self.local_variables]
        broadcast_variables(shared, root, getattr(self, "comm", None))

    def _broadcast_optimizer(self) -> None:
        opt = getattr(self.model, "optimizer", None)
        variables = getattr(opt, "variables", None)
        if callable(variables):                      # Keras 2 legacy optimizers: a method
            variables = variables()
        built = getattr(opt, "built", None)
        if opt is not None and variables and built is not False:
            own = {id(v) for v in getattr(opt, "hpctrain_rank_local_variables", ())}   # (each rank's partial sums)
            self.broadcast([v for v in variables if id(v) not in own], self.root)
            self._optimizer_done = True

    def on_train_begin(self, logs=None):
        self._model_done = self._optimizer_done = False
        if getattr(self.model, "built", True):        # a model without input shape is built by its first step
            self.broadcast(self.model.variables, self.root)
            self._model_done = True
            self._broadcast_optimizer()

    def on_train_batch_end(self, batch, logs=None):
        if not getattr(self, "_model_done", True):
            self.broadcast(self.model.variables, self.root)
            self._model_done = True
        if not getattr(self, "_optimizer_done", True):
            self._broadcast_optimizer()


class MetricAverageMixin:
    """At the end of every epoch, replace each logged scalar metric by its mean over ranks.

    Put it first in ``callbacks`` so that the callbacks after it (checkpoint,
    early stopping, CSV logger) see the averaged values.  Cost: one all-reduce
    of the scalars per epoch.
    """

    def on_epoch_end(self, epoch, logs=None):
        if logs:
            scalars = {k: v for k, v in logs.items() if _is_scalar(v)}
            logs.update(average_metrics(scalars, getattr(self, "comm", None)))


def _is_scalar(v) -> bool:
    shape = getattr(v, "shape", ())
    return isinstance(v, (int, float)) or (shape is not None and len(shape) == 0 and hasattr(v, "dtype"))


class LearningRateScheduleMixin:
    """Set the learning rate to ``initial_lr * multiplier`` for epochs in ``[start_epoch, end_epoch)``.

    ``multiplier``: a number, or a function of the (fractional) epoch.
    ``staircase=True`` sets it at the start of each epoch; otherwise before
    every batch, at ``epoch + batch / steps_per_epoch``.  Outside the range
    the rate is left alone.  ``momentum_correction``: where the optimizer's
    momentum is a variable (Keras 2 legacy optimizers), it is scaled by
    new/old rate for the one batch where the rate changes (Goyal et al. 2017);
    elsewhere momentum is left alone.
    """

    def _setup_schedule(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                        start_epoch: float = 0, end_epoch: Optional[float] = None, staircase: bool = True,
                        momentum_correction: bool = True, steps_per_epoch: Optional[int] = None) -> None:
        if initial_lr <= 0:
            raise ValueError(f"initial_lr must be > 0, got {initial_lr}")
        self.initial_lr, self.start_epoch, self.end_epoch = float(initial_lr), start_epoch, end_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, m=float(multiplier): m)
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self._epoch, self._restore_momentum = 0, None

    def _in_range(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        opt = self.model.optimizer
        old, new = get_learning_rate(opt), self.initial_lr * self.multiplier(epoch)
        set_learning_rate(opt, new)
        momentum = getattr(opt, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old > 0 and new != old:
            self._restore_momentum = float(momentum.numpy())
            momentum.assign(self._restore_momentum * new / old)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.steps_per_epoch is None:
            self.steps_per_epoch = (self.params or {}).get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise ValueError(f"{type(self).__name__} needs steps_per_epoch: the dataset's length is unknown")
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase:
            epoch = self._epoch + batch / self.steps_per_epoch
            if self._in_range(epoch):
                self._adjust(epoch)

    def on_train_batch_end(self, batch, logs=None):
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = get_learning_rate(self.model.optimizer)


class LearningRateWarmupMixin(LearningRateScheduleMixin):
    """Ramp the learning rate from ``initial_lr / N`` to ``initial_lr`` over the first ``warmup_epochs``.

    Large data-parallel batches train with the rate scaled by N (Goyal et al.
    2017, "Accurate, Large Minibatch SGD"); starting at the single-process rate
    avoids early divergence.  At epoch progress ``e < warmup_epochs``:
    ``lr = initial_lr / N * (e (N - 1) / warmup_epochs + 1)``, set before
    every batch; from then on the rate is left alone.
    """

    def _setup_warmup(self, initial_lr: float, warmup_epochs: float = 5, momentum_correction: bool = True,
                      steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs must be > 0, got {warmup_epochs}")
        self.warmup_epochs, self.verbose = float(warmup_epochs), verbose

        def multiplier(epoch: float) -> float:
            n = comm_or_world(getattr(self, "comm", None)).size
            return 1.0 / n * (epoch * (n - 1) / self.warmup_epochs + 1)
        self._setup_schedule(initial_lr, multiplier, 0, warmup_epochs, False, momentum_correction,
                             steps_per_epoch)

    def learning_rate(self, progress: float) -> float:
        """The rate at epoch progress ``progress`` (epochs, fractional)."""
        return self.initial_lr * self.multiplier(progress) if progress < self.warmup_epochs else self.initial_lr

    def on_train_batch_begin(self, batch, logs=None):
        progress = self._epoch + batch / self.steps_per_epoch
        if progress < self.warmup_epochs:
            super().on_train_batch_begin(batch, logs)
            self._last = get_learning_rate(self.model.optimizer)
        elif getattr(self, "_last", None) is not None:
            # the ramp ends at initial_lr, unless another callback has set the rate meanwhile
            if get_learning_rate(self.model.optimizer) == self._last:
                set_learning_rate(self.model.optimizer, self.initial_lr)
            self._last = None
            if self.verbose and comm_or_world(getattr(self, "comm", None)).rank == 0:
                print(f"epoch {self._epoch}: learning-rate warm-up done, rate "
                      f"{get_learning_rate(self.model.optimizer):g}", file=sys.stderr)
