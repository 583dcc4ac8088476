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

Each flat buffer carries one extra element per parameter: 1 if this rank has a
gradient for it.  After the reduction a parameter keeps ``grad=None`` only if no
rank had a gradient, so optimizers such as Adam skip it exactly as a single
process would, and every rank applies the same update.

Cost per step: one copy of every gradient into its bucket and one back, plus
one all-reduce per bucket (2 (N-1)/N x bytes on the wire for ring-like
algorithms).  Memory: one flat buffer per bucket (the size of the gradients).
On one rank nothing is copied or sent: gradients are only averaged over the
accumulated passes (and sparse ones densified) in place.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List, Optional

import numpy as np
import torch

from ..agreement import check_same
from ..collectives.buckets import plan_buckets
from ..collectives.ops import check_gradient_reduction

__all__ = ["DistributedOptimizer"]

_CLASSES: Dict[type, type] = {}


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression=None, op: str = "avg", backward_passes_per_step: int = 1,
                         bucket_mb: float = 25, comm=None) -> torch.optim.Optimizer:
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
        compression: reserved for gradient compressors; only ``None`` today.
        op: ``"avg"`` (default) or ``"sum"`` over ranks.  With ``"avg"`` the
            gradients of k accumulated backward passes (``no_sync`` or
            ``backward_passes_per_step=k``) are averaged too, so k passes of
            batch B equal one pass of batch k*B for a mean loss.
        backward_passes_per_step: backward passes to accumulate locally
            before the gradients are all-reduced (call ``step()`` after them).
        bucket_mb: bucket size in MiB; larger buckets mean fewer messages,
            smaller ones start communicating earlier in backward.
        comm: the communicator to average over (default: the world).
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_gradient_reduction(op, compression)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
    if bucket_mb < 0:
        raise ValueError(f"bucket_mb must be >= 0, got {bucket_mb}")
    if comm is None:
        from .. import world
        comm = world()
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Distributed{base.__name__}", (_DistributedMixin, base),
                                    {"__module__": __name__, "__doc__": base.__doc__})
    sync = _GradientSync(optimizer, named_parameters, comm, op, backward_passes_per_step,
                         int(bucket_mb * 2 ** 20))
    optimizer.__class__ = cls
    optimizer._hpctrain = sync
    patched = optimizer.__dict__.get("step")
    if patched is not None:
        # Something (an LR scheduler created before this call) replaced step on the instance with a
        # wrapper of the original class's step, which would bypass the class swap: synchronize first.
        def step(closure=None):
            optimizer._before_step()
            return patched(closure)

        step.__dict__.update(getattr(patched, "__dict__", {}))   # keep the scheduler's markers
        optimizer.step = step
    return optimizer


class _DistributedMixin:
    """The methods a DistributedOptimizer adds to the wrapped optimizer's class."""

    _hpctrain: "_GradientSync"

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
        self._before_step()
        return super().step(closure)

    def _before_step(self) -> None:
        sync = self._hpctrain
        if not sync.skip and not sync.synchronized:
            sync.synchronize()
        sync.reset()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then no longer communicates)."""
        self._hpctrain.remove_hooks()


class _GradientSync:
    """The reducer behind one DistributedOptimizer: buckets, hooks and the per-step state."""

    def __init__(self, optimizer, named_parameters, comm, op: str, passes_per_step: int, cap_bytes: int):
        self.comm, self.op, self.k = comm, op, passes_per_step
        params: List[torch.Tensor] = []
        seen = set()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        self.params = params
        self.names = self._names(params, named_parameters)
        shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self.names, params)]
        check_same(comm, "the parameters given to DistributedOptimizer (name, shape, dtype)",
                   shapes, f"{len(shapes)} parameters, first differences: {shapes[:3]}")
        self.buckets = plan_buckets([(p.numel(), p.element_size(), (p.dtype, p.device)) for p in params],
                                    cap_bytes)
        self.bucket_of = {}
        for b in self.buckets:
            for m in b.members:
                self.bucket_of[m] = b.index
        self.flat = [torch.zeros(b.numel + len(b.members), dtype=b.kind[0], device=b.kind[1])
                     for b in self.buckets] if comm.size > 1 else []   # one rank sends nothing
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]
        self.skip = self.no_sync = False
        self.join_flag = False          # set by hpctrain.torch.Join
        self.reset()

    @staticmethod
    def _names(params, named_parameters) -> List[str]:
        if named_parameters is None:
            return [f"param{i}" for i in range(len(params))]
        by_id = {}
        for name, p in named_parameters:
            by_id.setdefault(id(p), name)
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's parameters "
                             f"(positions {missing[:10]}); pass model.named_parameters() of the model "
                             f"whose parameters the optimizer updates")
        return [by_id[id(p)] for p in params]

    # -- per-step state -----------------------------------------------------
    def reset(self) -> None:
        """Start a new step: nothing fired, nothing launched."""
        self.passes = 0
        self.in_backward = False
        self.fired = [False] * len(self.params)
        self.ready = [0] * len(self.buckets)
        self.launched = 0
        self.handles: List = [None] * len(self.buckets)
        self.flag_handle = None
        self.synchronized = False

    def _final_pass(self) -> bool:
        return not self.no_sync and self.passes >= self.k

    def _hook(self, i: int):
        def hook(param):
            if not self.in_backward:
                self._begin_backward()
            if self._final_pass() and not self.fired[i]:
                self.fired[i] = True
                self.ready[self.bucket_of[i]] += 1
                self._launch_ready()
        return hook

    def _begin_backward(self) -> None:
        if self.launched or self.synchronized:
            raise RuntimeError(
                "backward() ran again after the gradients of this step were sent; call optimizer.step() "
                f"after every {self.k} backward pass(es), or accumulate inside optimizer.no_sync()")
        self.in_backward = True
        self.passes += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.in_backward = False
        if self._final_pass():
            self._launch_upto(len(self.buckets))

    def _launch_ready(self) -> None:
        while self.launched < len(self.buckets) and \
                self.ready[self.launched] == len(self.buckets[self.launched].members):
            self._launch(self.launched)

    def _launch_upto(self, end: int) -> None:
        while self.launched < end:
            self._launch(self.launched)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if self.comm.size == 1:
            self._local(bucket)
        else:
            self._pack(bucket, self.flat[b])
        if b == 0 and self.join_flag:
            self.flag_handle = self.comm.allreduce_async(np.ones(1, dtype=np.int64))
        if self.comm.size > 1:
            self.handles[b] = self.comm.allreduce_async(self.flat[b], op=self.op, inplace=True)
        self.launched = b + 1

    def _local(self, bucket) -> None:
        """One rank: the reduction is the identity, so only densify and average over the passes, in place."""
        with torch.no_grad():
            for i in bucket.members:
                p = self.params[i]
                if p.grad is not None and p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
                if p.grad is not None and self.op == "avg" and self.passes > 1:
                    p.grad.div_(self.passes)

    def _pack(self, bucket, flat) -> None:
        """Copy the bucket's gradients (and one has-gradient flag per parameter) into its flat buffer."""
        with torch.no_grad():
            for j, (i, off, n) in enumerate(zip(bucket.members, bucket.offsets, bucket.numels)):
                g = self.params[i].grad
                if g is None:
                    flat[off:off + n].zero_()
                    flat[bucket.numel + j] = 0
                else:
                    flat[off:off + n].copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
                    flat[bucket.numel + j] = 1
            if self.op == "avg" and self.passes > 1:
                flat[:bucket.numel].div_(self.passes)

    def synchronize(self) -> None:
        """Launch what is left, wait for every bucket and write the reduced gradients back."""
        if self.synchronized:
            return
        self._launch_upto(len(self.buckets))
        if self.flag_handle is not None:
            self.flag_handle.wait()
        for b, h in enumerate(self.handles):
            if h is not None:       # None: one rank, nothing was sent
                self.apply(b, h.wait())
        self.synchronized = True

    def apply(self, b: int, reduced: torch.Tensor) -> None:
        """Write bucket ``b``'s reduced buffer into the gradients (None where no rank had one)."""
        bucket = self.buckets[b]
        flags = reduced[bucket.numel:].tolist()
        with torch.no_grad():
            for j, (i, off, n) in enumerate(zip(bucket.members, bucket.offsets, bucket.numels)):
                p = self.params[i]
                if flags[j] == 0:
                    p.grad = None
                elif p.grad is None or p.grad.is_sparse:
                    p.grad = reduced[off:off + n].view_as(p).clone()
                else:
                    p.grad.copy_(reduced[off:off + n].view_as(p))

    def shadow(self) -> None:
        """Take part in one step with zero gradients (a rank that has run out of data)."""
        for flat in self.flat:
            flat.zero_()
        handles = [self.comm.allreduce_async(flat, op=self.op, inplace=True) for flat in self.flat]
        for b, h in enumerate(handles):
            self.apply(b, h.wait())

    def remove_hooks(self) -> None:
        """Detach the gradient hooks."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
