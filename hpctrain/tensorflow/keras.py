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

import time
from typing import List, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from .. import settings
from ..adasum_updates import AdasumUpdates
from ..checkpoint.spread import RANK_STATES_FORMAT
from ..gradients import GradientAverager
from .adasum_apply import apply_with_adasum
from .aggregation import Aggregation
from .keras_callbacks import BroadcastMixin, LearningRateScheduleMixin, LearningRateWarmupMixin, MetricAverageMixin
from .ops import CurrentAverager, average_gradients, follow_the_world, host_call, swap_class
from .tape import _name
from .local_sgd import LocalSGDOptimizer
from .zero import ShardedOptimizer

__all__ = ["DistributedOptimizer", "ShardedOptimizer", "LocalSGDOptimizer", "BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "StepMetricsCallback",
           "TimelineCallback"]

class _DistributedMixin:
    """Reduces the gradients over ranks in ``apply`` (which ``apply_gradients`` and ``model.fit`` call)."""

    _hpctrain_marks = None     # a TimelineCallback's _StepMarks while one is in use
    _hpctrain_agg = None       # the Aggregation of backward_passes_per_step > 1
    hpctrain_state_format = RANK_STATES_FORMAT

    @property
    def hpctrain_state_spans_ranks(self) -> bool:
        """With op='adasum', or ``backward_passes_per_step > 1`` (its partial sums), each rank's optimizer
        variables are its own (checkpoints write every rank's)."""
        return isinstance(self._hpctrain, AdasumUpdates) or self._hpctrain_agg is not None

    def consolidate_state_dict(self, to=0) -> None:
        """Nothing to gather (the torch adapter's API): with op='adasum' a checkpoint takes each rank's part."""

    def shard_state_dict(self) -> tuple:
        """``(common, own)`` with op='adasum' or aggregation: this rank's own optimizer variables."""
        return ({"format": RANK_STATES_FORMAT, "world": self._hpctrain.comm.size},
                {"variables": [np.asarray(v.numpy()) for v in self.variables]})

    def load_shard_state_dict(self, common: dict, read) -> None:
        """Take this rank's optimizer variables back; at another world size saved rank ``rank mod N``'s."""
        own = read(self._hpctrain.comm.rank % int(common["world"]))["variables"]
        if len(own) != len(self.variables):
            raise ValueError(f"the checkpoint has {len(own)} optimizer variables, this optimizer {len(self.variables)}"
                             + (" (build it first: optimizer.build(model.trainable_variables))"
                                if not self.variables else ""))
        for v, value in zip(self.variables, own):
            v.assign(np.asarray(value))
        agg = self._hpctrain_agg
        if agg is not None and int(common["world"]) != self._hpctrain.comm.size and int(agg.counter.numpy()):
            raise ValueError(f"this checkpoint was written {int(agg.counter.numpy())} pass(es) into a round of "
                             f"backward_passes_per_step={agg.k} at {common['world']} ranks: its partial sums resume "
                             f"only at {common['world']} ranks, not {self._hpctrain.comm.size} (save after an update)")

    def scale_loss(self, loss):
        """The optimizer's ``scale_loss`` (``fit`` calls it once the loss exists), marking the end of forward."""
        loss = super().scale_loss(loss)
        if self._hpctrain_marks is None:
            return loss
        return _after(self._mark("forward"), [loss])[0]

    @property
    def hpctrain_rank_local_variables(self) -> list:
        """Optimizer variables that are each rank's own: the partial sums of ``backward_passes_per_step``."""
        return [] if self._hpctrain_agg is None else self._hpctrain_agg.variables

    def build(self, variables):
        """The wrapped optimizer's variables, then the aggregation's sums and counter (optimizer variables too, so
        that checkpoints and elastic commits hold a round of ``backward_passes_per_step`` half-way through)."""
        super().build(variables)
        if self._hpctrain_agg is not None:
            self._hpctrain_agg.build(variables)

    def apply(self, grads, trainable_variables=None):
        agg = self._hpctrain_agg
        if agg is None:
            return self._reduce_and_apply(list(grads), trainable_variables)
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        if not self.built:                      # (a tf.cond branch may not create the optimizer's variables)
            with tf.init_scope():
                self.build(variables)
            self.built = True
        return agg.step(list(grads), variables, lambda totals: self._reduce_and_apply(totals, variables),
                        lambda: None)           # (iterations counts updates, as Keras's own accumulation's does)

    def _reduce_and_apply(self, grads, trainable_variables=None):
        """The wrapped optimizer's ``apply`` of ``grads`` reduced over the ranks (with Adasum, of this rank's
        ``grads``, then the variables' changes combined)."""
        averager = CurrentAverager(self)    # (looked up when the traced op runs: a re-formed world replaces it)
        if isinstance(self._hpctrain, AdasumUpdates):
            variables = trainable_variables if trainable_variables is not None else self._trainable_variables
            return apply_with_adasum(averager, variables, lambda: super(_DistributedMixin, self).apply(
                grads, trainable_variables))
        names = None
        if averager.compressor is not None:
            variables = trainable_variables if trainable_variables is not None else self._trainable_variables
            names = [_name(v, i) for i, v in enumerate(variables)]
        if self._hpctrain_marks is None:
            return super().apply(average_gradients(averager, grads, names), trainable_variables)
        grads = _after(self._mark("backward", grads), grads)
        grads = average_gradients(averager, grads, names)
        return super().apply(_after(self._mark("synchronize gradients", grads), grads), trainable_variables)

    def _mark(self, phase: str, after=()):
        """Note the time ``phase`` ends (now eagerly; in a graph, an op that runs once ``after``'s tensors exist)."""
        def note():
            marks = self._hpctrain_marks           # read when the op runs: None once the callback is gone
            if marks is not None:
                marks.note(phase)
            return [np.zeros((), np.int8)]

        # host_call: a stateful op in a graph (with XLA's error where it cannot run), a plain call eagerly
        waits = [] if tf.executing_eagerly() else [g.values if isinstance(g, tf.IndexedSlices) else g
                                                   for g in after if g is not None]
        with tf.control_dependencies(waits):
            return host_call(note, [], [tf.int8], f"mark_{phase[:8]}")[0]

    def compression_stats(self) -> dict:
        """Bytes of gradient payload sent and received, per step and in total (:meth:`GradientAverager.stats`)."""
        return self._hpctrain.stats()


def _after(op, tensors):
    """``tensors`` (identities of them), each available only after ``op`` ran (no-op eagerly)."""
    if tf.executing_eagerly():
        return list(tensors)
    with tf.control_dependencies([op]):
        return [None if t is None else
                tf.IndexedSlices(tf.identity(t.values), t.indices, t.dense_shape) if isinstance(t, tf.IndexedSlices)
                else tf.identity(t) for t in tensors]


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, compression=None, op: str = "avg",
                         sparse_as_dense: bool = False, comm=None, compression_policy=None,
                         backward_passes_per_step: int = 1) -> keras.optimizers.Optimizer:
    """Make a Keras 3 optimizer average its gradients over ranks before every update.

    The optimizer object itself is returned with its class changed to a
    subclass of its own (``isinstance``, ``get_config``, learning-rate
    schedules, ``gradient_accumulation_steps`` and checkpoints of its
    variables keep working).  Gradients are reduced by
    :func:`hpctrain.tensorflow.reduce_gradients`: one fused all-reduce per step
    after backward (Keras computes all gradients before ``apply``).

    Formula: ``g = (1/N) sum_r g_r`` (``op="avg"``) or the plain sum.  With
    ``backward_passes_per_step=k`` each rank sums its gradients locally over
    ``k`` passes and the average ``(1/(kN)) sum_r sum_p g_rp`` is reduced and
    applied on every ``k``-th pass (one reduction per ``k`` passes;
    :mod:`hpctrain.tensorflow.aggregation`); ``iterations`` counts updates.
    Keras's own ``gradient_accumulation_steps=k`` gives the same updates (its
    ``iterations`` counts updates too, but its learning-rate schedule steps
    per pass) and all-reduces on every micro-batch (``k`` times the traffic).

    Args:
        optimizer: any ``keras.optimizers.Optimizer``.
        compression: a compressor of :mod:`hpctrain.compression` (or its
            name); gradients are named by their variables' paths.
        op: ``"avg"``, ``"sum"``, or ``"adasum"``: each rank applies its own
            gradients and the variables' changes are combined with Adasum
            (:mod:`hpctrain.adasum_updates`; do not scale the learning rate by
            the number of ranks; compression None or ``"fp16"``).
        sparse_as_dense: densify ``IndexedSlices`` gradients before reducing
            (the sparse policy: :mod:`hpctrain.gradients`).
        comm: the communicator (default: the world).
        compression_policy: which gradients are compressed (default
            :class:`hpctrain.compression.Policy`).
        backward_passes_per_step: passes accumulated locally (averaged)
            before one reduction and one update; not with the optimizer's own
            ``gradient_accumulation_steps``.
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
    if backward_passes_per_step > 1:
        settings.refuse_under_elastic(
            "backward_passes_per_step > 1 (Keras)", "each rank's partial sums of a round are its own, and a "
            "re-formed world takes rank 0's variables", "use the optimizer's own gradient_accumulation_steps (it "
            "all-reduces every pass, so its sums agree), or launch without --elastic")
    if backward_passes_per_step > 1 and optimizer.gradient_accumulation_steps:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} and the optimizer's "
                         f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps} both accumulate: "
                         "choose one (backward_passes_per_step reduces once per round)")
    if op == "adasum":
        averager = AdasumUpdates(comm, compression)
    else:
        averager = GradientAverager(comm, op, compression, compression_policy, sparse_as_dense)
    swap_class(optimizer, _DistributedMixin, "Distributed")
    optimizer._hpctrain = averager
    if backward_passes_per_step > 1:
        optimizer._hpctrain_agg = Aggregation(
            backward_passes_per_step, True, lambda shape, dtype, name: optimizer.add_variable(
                shape, initializer="zeros", dtype=dtype, name=name))
        if optimizer.built:
            optimizer._hpctrain_agg.build(optimizer._trainable_variables)
    if comm is None:
        follow_the_world(optimizer, op, compression, compression_policy, sparse_as_dense)
    return optimizer


class BroadcastGlobalVariablesCallback(BroadcastMixin, keras.callbacks.Callback):
    __doc__ = BroadcastMixin.__doc__

    def __init__(self, root: int = 0, comm=None):
        super().__init__()
        self.root, self.comm, self._optimizer_done = root, comm, False


class MetricAverageCallback(MetricAverageMixin, keras.callbacks.Callback):
    __doc__ = MetricAverageMixin.__doc__

    def __init__(self, comm=None):
        super().__init__()
        self.comm = comm


class LearningRateScheduleCallback(LearningRateScheduleMixin, keras.callbacks.Callback):
    __doc__ = LearningRateScheduleMixin.__doc__

    def __init__(self, initial_lr: float, multiplier, start_epoch: float = 0, end_epoch: Optional[float] = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 comm=None):
        super().__init__()
        self.comm = comm
        self._setup_schedule(initial_lr, multiplier, start_epoch, end_epoch, staircase, momentum_correction,
                             steps_per_epoch)


class LearningRateWarmupCallback(LearningRateWarmupMixin, keras.callbacks.Callback):
    __doc__ = LearningRateWarmupMixin.__doc__ + """
    Args:
        initial_lr: the target rate (already scaled by N).
        warmup_epochs: length of the ramp in epochs.
        steps_per_epoch: batches per epoch; default: what ``fit`` reports
            (required when the dataset's length is unknown).
        verbose: rank 0 prints when the warm-up ends.
        momentum_correction: see :class:`LearningRateScheduleCallback`.
    """

    def __init__(self, initial_lr: float, warmup_epochs: float = 5, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0, comm=None, momentum_correction: bool = True):
        super().__init__()
        self.comm = comm
        self._setup_warmup(initial_lr, warmup_epochs, momentum_correction, steps_per_epoch, verbose)


class StepMetricsCallback(keras.callbacks.Callback):
    """Per-step metrics (:class:`hpctrain.observe.StepMetrics`) of ``model.fit``, in one line.

    ::

        model.fit(..., callbacks=[..., hk.StepMetricsCallback("runs/x", samples_per_step=batch_size)])

    A step ends at each ``on_train_batch_end``; the step's samples/s and
    exposed communication share are added to the batch logs (so Keras's
    progress bar shows them) as ``samples_per_s`` and ``comm_share``.  The
    compression ratio comes from an hpctrain DistributedOptimizer.  The
    metrics are gathered and the files closed at ``on_train_end``; ``metrics``
    is the StepMetrics of the last ``fit``.  ``options``: StepMetrics' others.
    """

    def __init__(self, log_dir: Optional[str] = None, samples_per_step: Optional[int] = None, comm=None,
                 **options):
        super().__init__()
        self.log_dir, self.samples_per_step, self.comm, self.options = log_dir, samples_per_step, comm, options
        self.metrics = None

    def on_train_begin(self, logs=None):
        from ..observe import StepMetrics

        stats = getattr(getattr(self.model, "optimizer", None), "compression_stats", None)
        self.metrics = StepMetrics(self.comm, self.log_dir, self.samples_per_step, compression=stats, **self.options)

    def on_train_batch_end(self, batch, logs=None):
        rec = self.metrics.mark()
        if logs is not None:
            logs["comm_share"] = rec["exposed_comm_fraction"]
            if rec["samples"]:
                logs["samples_per_s"] = rec["samples_per_s"] * self.metrics.comm.size

    def on_train_end(self, logs=None):
        self.metrics.close()


class _StepMarks:
    """The times at which the phases of one compiled train step ended, noted by the DistributedOptimizer's marks."""

    PHASES = ("forward", "backward", "synchronize gradients")

    def __init__(self):
        self.times: List[Tuple[str, float]] = []

    def note(self, phase: str) -> None:
        self.times.append((phase, time.perf_counter()))


class TimelineCallback(keras.callbacks.Callback):
    """Put every ``model.fit`` batch on the timeline as a "train step" span, split into its phases if asked.

    With ``split_steps=True`` and hpctrain's :func:`DistributedOptimizer`
    the step is split into "forward" (from the batch's start until the loss
    exists: the optimizer's ``scale_loss``), "backward" (until every
    gradient exists), "synchronize gradients" (the all-reduce, whose
    collectives the core records too) and "optimizer step" (the update,
    until the batch ends).  The split needs marks inside the compiled step:
    the callback adds them (``fit`` then retraces its step once); they are
    three Python calls from the step, which cost a few percent of a step of
    a few milliseconds (``benchmarks/observe_overhead.py --framework
    keras``), so they are asked for, as torch's forward spans are
    (:func:`hpctrain.torch.trace_forward`).  A step traced with them keeps
    them, inert, after the callback is gone.  With another optimizer, or
    ``steps_per_execution`` > 1, the batch is one span.  Turn the timeline on
    with HPCTRAIN_TIMELINE=path or ``comm.timeline.start()``.
    """

    def __init__(self, comm=None, split_steps: bool = False):
        super().__init__()
        self.comm, self.split_steps = comm, split_steps
        self._started = None
        self._marks: Optional[_StepMarks] = None

    def on_train_begin(self, logs=None):
        opt = getattr(self.model, "optimizer", None)
        if self.split_steps and isinstance(opt, _DistributedMixin) and opt._hpctrain_marks is None:
            self._marks = opt._hpctrain_marks = _StepMarks()
            self.model.make_train_function(force=True)        # trace the step again, with the marks

    def on_train_end(self, logs=None):
        if self._marks is not None:
            self.model.optimizer._hpctrain_marks = self._marks = None

    def on_train_batch_begin(self, batch, logs=None):
        from ..world import comm_or_world

        self._timeline = comm_or_world(self.comm).timeline
        self._started = time.perf_counter() if self._timeline.on else None
        if self._marks is not None:
            self._marks.times.clear()

    def on_train_batch_end(self, batch, logs=None):
        if self._started is None:
            return
        end, tl = time.perf_counter(), self._timeline
        tl.add("train step", "keras", self._started, end, {"batch": int(batch)})
        times = self._marks.times if self._marks is not None else []
        if [name for name, _ in times] == list(_StepMarks.PHASES):
            starts = [self._started] + [t for _, t in times]
            for name, a, b in zip(_StepMarks.PHASES + ("optimizer step",), starts, starts[1:] + [end]):
                tl.add(name, "keras", a, b)
