"""DistributedOptimizer: all-reduce gradients in buckets while backward is still running.

How it works (the same scheme as PyTorch DDP's reducer):

* Parameters are grouped once into buckets of about ``bucket_mb`` MiB, in
  reverse order of registration (:func:`hpctrain.collectives.buckets.plan_buckets`).
* A post-accumulate-grad hook on every parameter marks it ready.  When every
  parameter of the next bucket is ready, its gradients are packed into one flat
  buffer and an asynchronous all-reduce starts on hpctrain's collective thread
  while autograd computes the remaining gradients.  Buckets are launched
  strictly in order, so every rank issues the same collectives in the same
  order even when different parameters are unused on different ranks.
* At the end of the backward pass the buckets still waiting (parameters that
  got no gradient) are launched too; ``step()`` only waits for what is still in
  flight and copies the averaged gradients back.

Each flat buffer carries two flags per parameter (:func:`hpctrain.gradients.bucket_length`):
this rank has a gradient for it; it is sparse and travels as rows.  After the
reduction a parameter keeps ``grad=None`` only if no rank had a gradient, so
optimizers such as Adam skip it exactly as a single process would, and every
rank applies the same update.  Sparse gradients follow the policy of
:mod:`hpctrain.gradients` (the same as TensorFlow's ``IndexedSlices``): every
rank's rows are gathered, unless ``sparse_as_dense=True``.

Cost per step: one copy of every gradient into its bucket and one back, plus
one all-reduce per bucket (2 (N-1)/N x bytes on the wire for ring-like
algorithms).  Memory: one flat buffer per bucket (the size of the gradients).
On one rank nothing is copied or sent: gradients are only averaged over the
accumulated passes in place.  The buckets and hooks are
:class:`hpctrain.torch.gradient_sync.GradientSync`'s, the reduction
:class:`hpctrain.gradients.GradientAverager`'s.

With a compressor (``compression=``, see :mod:`hpctrain.compression`) each
bucket is compressed as soon as it is ready, while backward goes on, and its
payloads travel asynchronously; ``step()`` decompresses.  The has-gradient
flags travel uncompressed.  On one rank the compressor still runs (so a
1-rank run trains with the same method).  CUDA and bfloat16 buckets are
staged through a float32 host copy for the compressor.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional

import torch

from ..compression import Policy
from ..gradients import GradientAverager
from .adasum_optimizer import _AdasumMixin, wrap_adasum
from .class_swap import subclass_with
from .gradient_sync import GradientSync

__all__ = ["DistributedOptimizer"]



def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression=None, op: str = "avg", backward_passes_per_step: int = 1,
                         bucket_mb: float = 25, comm=None, compression_policy: Optional[Policy] = None,
                         sparse_as_dense: bool = False, bucket_strategy=None) -> torch.optim.Optimizer:
    """Make ``optimizer`` average its gradients across ranks before every step.

    The optimizer object itself is returned, its class changed to a subclass
    of its own class (``isinstance`` checks, param groups, state, learning-rate
    schedulers and ``state_dict`` keep working).  Create it on every rank, with
    the same parameters in the same order; broadcast the initial parameters
    (:func:`hpctrain.torch.broadcast_parameters`) so replicas start equal.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: ``model.named_parameters()``, used to name
            parameters in error messages; every optimizer parameter must appear.
        compression: a compressor from :mod:`hpctrain.compression` (or its
            name, e.g. ``"fp16"``); ``None`` sends float32.  Its state
            (residuals, ...) lives in the compressor object: checkpoint it as
            ``Sharded(compressor)``.  Parameters are named in the compressor by
            their ``named_parameters`` names (``param<i>`` without them).
        op: ``"avg"`` (default) or ``"sum"`` over ranks.  With ``"avg"`` the
            gradients of k accumulated backward passes (``no_sync`` or
            ``backward_passes_per_step=k``) are averaged too, so k passes of
            batch B equal one pass of batch k*B for a mean loss.
            ``"adasum"``: each rank steps on its own gradients and the
            parameter deltas are combined with Adasum
            (:mod:`hpctrain.adasum_updates`: do not scale the learning rate
            by the number of ranks; ``compression`` None or ``"fp16"``;
            gradients of k passes are summed by autograd, as in Horovod).
        backward_passes_per_step: backward passes to accumulate locally
            before the gradients are all-reduced (call ``step()`` after them).
        bucket_mb: bucket size in MiB; larger buckets mean fewer messages,
            smaller ones start communicating earlier in backward.
        comm: the communicator to average over (default: the world).
        compression_policy: which parameters are compressed (default
            :class:`hpctrain.compression.Policy`: not biases, norms or tensors
            under 1024 values).
        sparse_as_dense: densify sparse gradients (``nn.Embedding(sparse=True)``)
            and reduce them with the dense ones, instead of gathering every
            rank's rows (the policy and its cost: :mod:`hpctrain.gradients`);
            a gradient that was sparse is handed back sparse (``to_sparse``),
            so optimizers such as SparseAdam keep working.
        bucket_strategy: how a bucket of gradients is reduced (:mod:`hpctrain.bucket_strategies`: a name or a
            strategy; default the communicator's own, an all-reduce); kept when the optimizer follows a
            re-formed world.
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _AdasumMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
    if bucket_mb < 0:
        raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
    if op == "adasum":
        wrap_adasum(optimizer, named_parameters, comm, compression)
    else:
        averager = GradientAverager(comm, op, compression, compression_policy, sparse_as_dense, bucket_strategy)
        base = type(optimizer)
        cls = subclass_with(_DistributedMixin, base, f"Distributed{base.__name__}")
        sync = GradientSync(optimizer, named_parameters, averager, backward_passes_per_step,
                            int(bucket_mb * 2 ** 20))
        optimizer.__class__ = cls
        optimizer._hpctrain = sync
        if comm is None:
            _follow_the_world(optimizer, (op, compression, compression_policy, sparse_as_dense),
                              backward_passes_per_step, int(bucket_mb * 2 ** 20))
    keep_patched_step(optimizer)
    return optimizer


def keep_patched_step(optimizer) -> None:
    """Route a ``step`` set on the instance (an LR scheduler made before the class swap) through ``_around_step``.

    Such a wrapper calls the original class's step and would bypass the swap.
    """
    patched = optimizer.__dict__.get("step")
    if patched is not None:
        def step(closure=None):
            return optimizer._around_step(patched, closure)

        step.__dict__.update(getattr(patched, "__dict__", {}))   # keep the scheduler's markers
        optimizer.step = step


def _follow_the_world(optimizer, averaging: tuple, passes: int, cap_bytes: int) -> None:
    """Rebuild ``optimizer``'s buckets and hooks on the new world each time the world re-forms (elastic mode).

    Held weakly: a dropped optimizer stops following.  The compressor object
    carries over (one that keeps state between steps is refused under
    HPCTRAIN_ELASTIC: a commit does not hold its state).
    """
    from ..world import on_reform

    on_reform(lambda opt, world: rebuild_on(opt, world, averaging, passes, cap_bytes), owner=optimizer)


def rebuild_on(optimizer, comm, averaging: tuple, passes: int, cap_bytes: int) -> None:
    """Give DistributedOptimizer ``optimizer`` new buckets and hooks over ``comm`` (a re-formed world).

    Collective over ``comm`` (the buckets' shared memory).  ``averaging`` is
    ``(op, compression, compression_policy, sparse_as_dense)``; the compressor
    object in use carries over (only one that keeps no state between steps:
    the others are refused under HPCTRAIN_ELASTIC).
    """
    old = optimizer._hpctrain
    old.remove_hooks()
    op, compression, policy, sparse_as_dense = averaging
    compression = old.averager.compressor if old.averager.compressor is not None else compression
    averager = GradientAverager(comm, op, compression, policy, sparse_as_dense, old.averager.chosen_strategy)
    optimizer._hpctrain = GradientSync(optimizer, list(zip(old.names, old.params)), averager, passes, cap_bytes)


class _DistributedMixin:
    """The methods a DistributedOptimizer adds to the wrapped optimizer's class."""

    _hpctrain: GradientSync
    hpctrain_passes = "averaged"        # (gradients of passes accumulated in no_sync() are averaged by step())

    def synchronize(self) -> None:
        """Finish all-reducing the gradients now (before clipping them, say); ``step()`` then skips it."""
        self._hpctrain.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Within this context ``step()`` does not synchronize (call ``synchronize()`` yourself first)."""
        self._hpctrain.skip = True
        try:
            yield
        finally:
            self._hpctrain.skip = False

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context backward passes only accumulate gradients locally (no communication)."""
        self._hpctrain.no_sync = True
        try:
            yield
        finally:
            self._hpctrain.no_sync = False

    def step(self, closure=None):
        """Wait for the averaged gradients (unless already synchronized or skipped), then step."""
        timeline = self._hpctrain.comm.timeline
        if not timeline.on:
            self._before_step()
            return super().step(closure)
        with timeline.span("synchronize gradients", "torch"):
            self._before_step()
        with timeline.span("optimizer step", "torch"):
            return super().step(closure)

    def _around_step(self, local_step, closure=None):
        self._before_step()
        return local_step(closure)

    def _before_step(self) -> None:
        sync = self._hpctrain
        if not sync.skip and not sync.synchronized:
            sync.synchronize()
        sync.reset()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then no longer communicates)."""
        self._hpctrain.remove_hooks()

    def compression_stats(self) -> dict:
        """Bytes of gradient payload sent and received, per step and in total (:meth:`GradientAverager.stats`)."""
        return self._hpctrain.stats()




# torch wraps a class's ``step`` to run the optimizer's step hooks once it sees an instance's __init__ or
# __setstate__ (a copy, an unpickling) unless the function says it is wrapped already.  The wrapped
# optimizer's own step (reached through super()) is wrapped and runs them: marking this one stops a second run.
_DistributedMixin.step.hooked = True
