"""Horovod's Keras API for a given Keras: ``hpctrain.horovod.tensorflow.keras`` (``tf.keras``) and
``hpctrain.horovod.keras`` (``keras``) are both made of :func:`build`.

Keras 3, and Keras 2 through the ``tf-keras`` package (``TF_USE_LEGACY_KERAS=1``,
as Horovod's users keep Keras 2 code on TF >= 2.16), are both served: the
optimizer wrapper is :mod:`hpctrain.horovod.keras_optimizer`, the callbacks
are :mod:`hpctrain.tensorflow.keras_callbacks` on the module's own
``Callback`` class.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict

import tensorflow as tf

from ..tensorflow.tape import var_key
from ..tensorflow.keras_callbacks import (BroadcastMixin, LearningRateScheduleMixin, LearningRateWarmupMixin,
                                          MetricAverageMixin)
from . import basics
from .basics import Average, global_process_set
from .gradient_args import gradient_settings
from .keras_optimizer import HorovodKerasOptimizer, distributed_class, wrap_optimizer
from .negotiated import NegotiatedComm
from .tensorflow import allgather as _allgather
from .tensorflow import allreduce as _allreduce
from .tensorflow import broadcast as _broadcast
from .tensorflow import broadcast_global_variables
from .tensorflow import reducescatter as _reducescatter
from .tensorflow.compression import Compression
from .tensorflow.sync_batch_norm import sync_batch_norm_class

__all__ = ["build", "callback_classes", "populate", "PUBLIC"]

PUBLIC = basics.PUBLIC + ["Compression", "DistributedOptimizer", "PartialDistributedOptimizer", "load_model",
                          "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_global_variables",
                          "SyncBatchNormalization", "elastic"]


def callback_classes(callback_base: type, module: str) -> Dict[str, type]:
    """Horovod's Keras callbacks on ``callback_base`` (a Keras ``Callback`` class), by name."""

    class BroadcastGlobalVariablesCallback(BroadcastMixin, callback_base):
        __doc__ = BroadcastMixin.__doc__

        def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
            super().__init__()
            self.root, self._optimizer_done = root_rank, False
            self.local_variables = frozenset(var_key(v) for v in (local_variables or []))

        @property
        def comm(self):
            """The world's negotiated communicator (Horovod's callbacks act on every rank)."""
            return NegotiatedComm()

    class MetricAverageCallback(MetricAverageMixin, callback_base):
        __doc__ = MetricAverageMixin.__doc__

        def __init__(self, device: str = ""):
            super().__init__()

        @property
        def comm(self):
            """The world's negotiated communicator (Horovod's callbacks act on every rank)."""
            return NegotiatedComm()

    class LearningRateScheduleCallback(LearningRateScheduleMixin, callback_base):
        __doc__ = LearningRateScheduleMixin.__doc__

        def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                     momentum_correction=True, steps_per_epoch=None):
            super().__init__()
            self._setup_schedule(initial_lr, multiplier, start_epoch, end_epoch, staircase, momentum_correction,
                                 steps_per_epoch)

    class LearningRateWarmupCallback(LearningRateWarmupMixin, callback_base):
        __doc__ = LearningRateWarmupMixin.__doc__

        def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None,
                     verbose=0):
            super().__init__()
            self._setup_warmup(initial_lr, warmup_epochs, momentum_correction, steps_per_epoch, verbose)

    classes = {c.__name__: c for c in (BroadcastGlobalVariablesCallback, MetricAverageCallback,
                                       LearningRateScheduleCallback, LearningRateWarmupCallback)}
    for c in classes.values():
        c.__module__, c.__qualname__ = module, c.__name__
    return classes


def _optimizer_classes(keras) -> list:
    """Every optimizer class the Keras module defines (for ``load_model``), subclasses of subclasses too."""
    found, todo = [], [keras.optimizers.Optimizer]
    legacy = getattr(keras.optimizers, "legacy", None)
    if legacy is not None and hasattr(legacy, "Optimizer"):
        todo.append(legacy.Optimizer)
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in found and not issubclass(sub, HorovodKerasOptimizer):
                found.append(sub)
                todo.append(sub)
    return found


def build(keras) -> SimpleNamespace:
    """Return Horovod's Keras functions (DistributedOptimizer, load_model, value collectives) for ``keras``."""

    def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="", compression=Compression.none,
                             sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                             backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                             groups=None, process_set=global_process_set, scale_local_gradients=True):
        """Make a Keras optimizer reduce its gradients over the process set before every update.

        The same object is returned, its class changed to a subclass of its
        own (see :mod:`hpctrain.horovod.keras_optimizer` for
        ``backward_passes_per_step`` and local variables); ``num_groups``/
        ``groups`` are accepted and change nothing (one fused reduction per step).
        """
        settings = gradient_settings(compression, op, gradient_predivide_factor, process_set)
        return wrap_optimizer(optimizer, settings, process_set, sparse_as_dense, backward_passes_per_step,
                              average_aggregated_gradients, scale_local_gradients)

    def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                                    compression=Compression.none, sparse_as_dense=False,
                                    gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                                    average_aggregated_gradients=False, groups=None,
                                    process_set=global_process_set, local_layers=None, scale_local_gradients=True):
        """A :func:`DistributedOptimizer` whose ``local_layers`` (Keras layers) keep their gradients local."""
        layers = [] if local_layers is None else (
            list(local_layers) if isinstance(local_layers, (list, tuple, set)) else [local_layers])
        bad = [type(layer).__name__ for layer in layers if not hasattr(layer, "trainable_weights")]
        if bad:
            raise ValueError(f"local_layers must be Keras layers, got {bad}")
        opt = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
        for layer in layers:
            for var in layer.trainable_weights:
                opt.register_local_var(var)
        return opt

    def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
                   legacy_opts=False):
        """``keras.models.load_model`` whose saved optimizer comes back wrapped by :func:`DistributedOptimizer`.

        ``custom_optimizers``: optimizer classes of your own the file names.
        """
        settings = gradient_settings(compression, Average, 1.0, global_process_set)
        objects: Dict[str, Any] = {}
        for cls in _optimizer_classes(keras) + list(custom_optimizers or []):
            objects[cls.__name__] = objects[cls.__name__.lower()] = distributed_class(cls, settings,
                                                                                      global_process_set)
        objects.update(custom_objects or {})
        return keras.models.load_model(filepath, custom_objects=objects)

    def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
                  compression=Compression.none):
        """Return ``value`` (array or tensor) reduced over the ranks (default op Average), as a tensor."""
        return _allreduce(tf.constant(value), average=average, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, op=op, compression=compression, name=name)

    def allgather(value, name=None):
        """Return every rank's ``value`` concatenated along dim 0, as a tensor."""
        return _allgather(tf.constant(value), name=name)

    def broadcast(value, root_rank, name=None):
        """Return world rank ``root_rank``'s ``value``, as a tensor."""
        return _broadcast(tf.constant(value), root_rank, name=name)

    def reducescatter(value, name=None, op=Average):
        """Return this rank's block of dim 0 of the reduction of ``value``, as a tensor."""
        return _reducescatter(tf.constant(value), op=op, name=name)

    return SimpleNamespace(DistributedOptimizer=DistributedOptimizer,
                           PartialDistributedOptimizer=PartialDistributedOptimizer, load_model=load_model,
                           allreduce=allreduce,
                           allgather=allgather, broadcast=broadcast, reducescatter=reducescatter,
                           broadcast_global_variables=broadcast_global_variables)


def populate(namespace: Dict[str, Any], keras, module: str) -> None:
    """Fill a module's ``namespace`` with Horovod's Keras API (:data:`PUBLIC`) for ``keras``."""
    api = build(keras)
    for name in PUBLIC:
        if hasattr(basics, name):
            namespace[name] = getattr(basics, name)
        elif hasattr(api, name):
            namespace[name] = getattr(api, name)
    from .tensorflow import elastic

    namespace.update(Compression=Compression, elastic=elastic,
                     SyncBatchNormalization=sync_batch_norm_class(keras.layers.BatchNormalization, module))
