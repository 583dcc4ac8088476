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

With a compressor (``compression=``, see :mod:`hpctrain.compression`) each
bucket is compressed as soon as it is ready, while backward goes on, and its
payloads travel asynchronously; ``step()`` decompresses.  The has-gradient
flags travel uncompressed.  On one rank the compressor still runs (so a
1-rank run trains with the same method).  CUDA and bfloat16 buckets are
staged through a float32 host copy for the compressor.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List, Optional

import numpy as np
import torch

from ..agreement import check_same
from ..collectives.buckets import plan_buckets
from ..compression import Policy, gradient_compressor, reducer_for

__all__ = ["DistributedOptimizer"]

_CLASSES: Dict[type, type] = {}


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                         compression=None, op: str = "avg", backward_passes_per_step: int = 1,
                         bucket_mb: float = 25, comm=None, compression_policy: Optional[Policy] = None
                         ) -> torch.optim.Optimizer:
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
        backward_passes_per_step: backward passes to accumulate locally
            before the gradients are all-reduced (call ``step()`` after them).
        bucket_mb: bucket size in MiB; larger buckets mean fewer messages,
            smaller ones start communicating earlier in backward.
        comm: the communicator to average over (default: the world).
        compression_policy: which parameters are compressed (default
            :class:`hpctrain.compression.Policy`: not biases, norms or tensors
            under 1024 values).
    """
    if isinstance(optimizer, _DistributedMixin):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    compressor = gradient_compressor(op, compression)
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
    reducer = reducer_for(compressor, comm, compression_policy) if compressor is not None else None
    sync = _GradientSync(optimizer, named_parameters, comm, op, backward_passes_per_step,
                         int(bucket_mb * 2 ** 20), reducer)
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

    def compression_stats(self) -> dict:
        """Bytes of gradient payload sent and received, per step and in total (see ``CompressedReducer.stats``).

        Without a compressor: the float32 bytes of the buckets.
        """
        return self._hpctrain.stats()


class _GradientSync:
    """The reducer behind one DistributedOptimizer: buckets, hooks and the per-step state."""

    def __init__(self, optimizer, named_parameters, comm, op: str, passes_per_step: int, cap_bytes: int,
                 reducer=None):
        self.comm, self.op, self.k, self.reducer = comm, op, passes_per_step, reducer
        self.steps = 0
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
        self.flat = [self._bucket_buffer(b) for b in self.buckets] if comm.size > 1 or reducer else []
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]
        self.skip = self.no_sync = False
        self.join_flag = False          # set by hpctrain.torch.Join
        self.reset()

    def _bucket_buffer(self, bucket) -> torch.Tensor:
        """A zeroed flat buffer for ``bucket``: in node-shared memory when it is a CPU float32/float64 bucket.

        Shared memory (:meth:`Communicator.shared_empty`) lets the all-reduce
        read the peers' buffers in place, with no copy in or out.
        """
        dtype, device = bucket.kind
        n = bucket.numel + len(bucket.members)
        if device.type == "cpu" and dtype in (torch.float32, torch.float64) and self.reducer is None:
            flat = torch.from_numpy(self.comm.shared_empty(n, np.float32 if dtype == torch.float32 else np.float64))
            return flat.zero_()
        return torch.zeros(n, dtype=dtype, device=device)

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
        if self.flat:
            self._pack(bucket, self.flat[b])
        else:
            self._local(bucket)
        if b == 0 and self.join_flag:
            self.flag_handle = self.comm.allreduce_async(np.ones(1, dtype=np.int64))
        if self.flat:
            self.handles[b] = self._reduce_async(b)
        self.launched = b + 1

    def _reduce_async(self, b: int):
        """Start reducing bucket ``b``'s flat buffer; the handle's ``wait()`` returns the reduced buffer."""
        flat = self.flat[b]
        if self.reducer is None:
            return self.comm.allreduce_async(flat, op=self.op, inplace=True)
        return _CompressedBucket(self, b, flat)

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
                    if g.is_sparse or g.data_ptr() != flat[off:off + n].data_ptr() or g.dtype != flat.dtype:
                        flat[off:off + n].copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
                    flat[bucket.numel + j] = 1        # (else: the gradient is already its bucket's view)
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
        self._count_step()

    def _count_step(self) -> None:
        self.steps += 1
        if self.reducer is not None:
            self.reducer.count_step()

    def stats(self) -> dict:
        """The compressor's traffic figures, or the float32 bucket bytes without one."""
        if self.reducer is not None:
            return self.reducer.stats()
        nbytes = sum(b.numel * self.params[b.members[0]].element_size() for b in self.buckets) \
            if self.comm.size > 1 else 0
        return {"compressor": None, "steps": self.steps, "sent_bytes_per_step": nbytes,
                "received_bytes_per_step": nbytes, "dense_bytes_per_step": nbytes, "ratio_to_fp32": 1.0}

    def apply(self, b: int, reduced: torch.Tensor) -> None:
        """Point the gradients at bucket ``b``'s reduced buffer (None where no rank had one).

        When the reduction ran in the bucket's own buffer, each gradient
        becomes a view of it (as DDP's ``gradient_as_bucket_view``): nothing is
        copied back, and a backward pass after ``zero_grad(set_to_none=False)``
        accumulates straight into the bucket, so packing copies nothing
        either.  The views are overwritten by the next step's reduction.
        """
        bucket = self.buckets[b]
        flags = reduced[bucket.numel:].tolist()
        own = self.flat and reduced.data_ptr() == self.flat[b].data_ptr()
        with torch.no_grad():
            for j, (i, off, n) in enumerate(zip(bucket.members, bucket.offsets, bucket.numels)):
                p = self.params[i]
                view = reduced[off:off + n].view_as(p)
                if flags[j] == 0:
                    p.grad = None
                elif own and view.dtype == p.dtype and view.stride() == p.stride():
                    if p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None or p.grad.is_sparse:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def shadow(self) -> None:
        """Take part in one step with zero gradients (a rank that has run out of data)."""
        for flat in self.flat:
            flat.zero_()
        handles = [self._reduce_async(b) for b in range(len(self.flat))]
        for b, h in enumerate(handles):
            self.apply(b, h.wait())
        self._count_step()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


class _CompressedBucket:
    """One bucket through the compressor: its gradients by name, its has-gradient flags uncompressed."""

    def __init__(self, sync: _GradientSync, b: int, flat: torch.Tensor):
        bucket = sync.buckets[b]
        self.flat = flat
        staged = flat.device.type != "cpu" or flat.dtype not in (torch.float32, torch.float64, torch.float16)
        self.host = flat.detach().to("cpu", torch.float32, copy=True) if staged else flat.detach()
        arr = self.host.numpy()
        entries = [(sync.names[i], arr[off:off + n].reshape(tuple(sync.params[i].shape)))
                   for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels)]
        self.pending = sync.reducer.start(entries, op=sync.op)
        self.flags = sync.comm.allreduce_async(arr[bucket.numel:], op=sync.op, inplace=True)
        self.staged = staged

    def wait(self) -> torch.Tensor:
        self.pending.wait()
        self.flags.wait()
        if self.staged:
            self.flat.copy_(self.host)
        return self.flat
