"""The reducer behind :func:`hpctrain.torch.DistributedOptimizer`: buckets filled by autograd hooks.

The reduction itself (flags, compression, sparse rows, statistics) is
:class:`hpctrain.gradients.GradientAverager`'s; this module only moves torch
gradients in and out of the buckets' flat buffers and follows autograd.

Per step: a post-accumulate-grad hook marks each parameter ready; when every
parameter of the next bucket is ready, the bucket is packed and its reduction
starts while backward goes on.  Buckets launch strictly in order, so every
rank issues the same collectives in the same order.  ``synchronize`` launches
the rest, waits, points the gradients at the reduced buffers and gathers the
rows of sparse gradients.  Cost: one copy of each gradient into its bucket
(none when the gradient already is a view of it) plus one collective per
bucket.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..agreement import check_same
from ..collectives.buckets import plan_buckets
from ..gradients import GradientAverager, bucket_length, no_rows

__all__ = ["GradientSync", "trainable_parameters"]


class GradientSync:
    """Buckets, hooks and per-step state of one DistributedOptimizer over ``averager``."""

    def __init__(self, optimizer, named_parameters, averager: GradientAverager, passes_per_step: int,
                 cap_bytes: int):
        self.averager, self.comm, self.op, self.k = averager, averager.comm, averager.op, passes_per_step
        params, self.names = trainable_parameters(optimizer, named_parameters, self.comm)
        self.params, self.shapes = params, [tuple(p.shape) for p in params]
        self.buckets = plan_buckets([(p.numel(), p.element_size(), self._kind(p)) for p in params], cap_bytes)
        self.bucket_of = {m: b.index for b in self.buckets for m in b.members}
        self.flat = [self._bucket_buffer(b) for b in self.buckets] if averager.communicates else []
        self.hooks = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(params)]
        self.skip = self.no_sync = False
        self.join_flag = False          # set by hpctrain.torch.Join
        self.reset()

    def _kind(self, param) -> tuple:
        """What parameters must share to share a bucket: dtype and device."""
        return param.dtype, param.device

    def _bucket_buffer(self, bucket) -> torch.Tensor:
        """A zeroed flat buffer for ``bucket``: in node-shared memory when it is a CPU float32/float64 bucket.

        Shared memory (:meth:`Communicator.shared_empty`) lets the all-reduce
        read the peers' buffers in place, with no copy in or out.
        """
        dtype, device = bucket.kind
        n = bucket_length(bucket)
        if device.type == "cpu" and dtype in (torch.float32, torch.float64) and self.averager.reducer is None:
            flat = torch.from_numpy(self.comm.shared_empty(n, np.float32 if dtype == torch.float32 else np.float64))
            return flat.zero_()
        return torch.zeros(n, dtype=dtype, device=device)

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
        self.rows_due: List = []

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
        self.backward_started = time.perf_counter()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self.in_backward = False
        timeline = self.comm.timeline
        if timeline.on:   # from the first gradient hook of the pass to its end
            timeline.add("backward", "torch", self.backward_started, time.perf_counter(), {"pass": self.passes})
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

    def _as_rows(self, g) -> bool:
        """Whether gradient ``g`` travels as rows (the sparse policy of :mod:`hpctrain.gradients`)."""
        return g.is_sparse and g.sparse_dim() == 1 and not self.averager.sparse_as_dense

    def _reduce_async(self, b: int):
        """Start reducing bucket ``b``'s flat buffer; the handle's ``wait()`` returns the reduced buffer."""
        flat, bucket = self.flat[b], self.buckets[b]
        if self.averager.reducer is None:
            return self.averager.start_bucket(flat, bucket, self.names, self.shapes)
        return _HostStaged(self.averager, flat, bucket, self.names, self.shapes)

    def _local(self, bucket) -> None:
        """One rank, no compressor: the reduction is the identity; average over the passes."""
        with torch.no_grad():
            for i in bucket.members:
                p = self.params[i]
                if p.grad is not None and self.op == "avg" and self.passes > 1:
                    p.grad = p.grad / self.passes if p.grad.is_sparse else p.grad.div_(self.passes)

    def _pack(self, bucket, flat) -> None:
        """Copy the bucket's dense gradients into its flat buffer and set each tensor's two flags."""
        m = len(bucket.members)
        with torch.no_grad():
            for j, (i, off, n) in enumerate(zip(bucket.members, bucket.offsets, bucket.numels)):
                g = self.params[i].grad
                rows = g is not None and self._as_rows(g)
                if g is None or rows:
                    flat[off:off + n].zero_()
                elif g.is_sparse or g.data_ptr() != flat[off:off + n].data_ptr() or g.dtype != flat.dtype:
                    flat[off:off + n].copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
                # (else: the gradient is already its bucket's view)
                flat[bucket.numel + j] = 0 if g is None else 1
                flat[bucket.numel + m + j] = 1 if rows else 0
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
        self._gather_rows()
        self.synchronized = True
        self.averager.count_step()

    def stats(self) -> dict:
        """The gradient traffic figures (:meth:`GradientAverager.stats`)."""
        return self.averager.stats()

    def apply(self, b: int, reduced: torch.Tensor) -> None:
        """Point the gradients at bucket ``b``'s reduced buffer (None where no rank had one).

        When the reduction ran in the bucket's own buffer, each gradient
        becomes a view of it (as DDP's ``gradient_as_bucket_view``): nothing is
        copied back, and a backward pass after ``zero_grad(set_to_none=False)``
        accumulates straight into the bucket, so packing copies nothing
        either.  The views are overwritten by the next step's reduction.
        Gradients that some rank sent as rows are finished by ``_gather_rows``.
        """
        bucket = self.buckets[b]
        has, rows, dense = self.averager.flags(reduced[bucket.numel:].tolist())
        own = self.flat and reduced.data_ptr() == self.flat[b].data_ptr()
        with torch.no_grad():
            for j, (i, off, n) in enumerate(zip(bucket.members, bucket.offsets, bucket.numels)):
                p = self.params[i]
                view = reduced[off:off + n].view_as(p)
                if not has[j]:
                    p.grad = None
                elif rows[j]:
                    self.rows_due.append((i, view.clone() if dense[j] else None))
                elif p.grad is not None and p.grad.is_sparse:      # densified to travel: sparse again
                    p.grad = view.to_sparse(p.grad.sparse_dim())
                elif own and view.dtype == p.dtype and view.stride() == p.stride():
                    if p.grad is None or p.grad.is_sparse or p.grad.data_ptr() != view.data_ptr():
                        p.grad = view
                elif p.grad is None or p.grad.is_sparse:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def _gather_rows(self, contribute: bool = True) -> None:
        """Gather the rows of every gradient some rank sent sparse; every rank does it in the same order.

        ``contribute=False``: this rank sends no rows (it shadows a step without data).
        """
        due, self.rows_due = self.rows_due, []
        for i, dense_part in due:
            p = self.params[i]
            g = p.grad if contribute else None
            wire = torch.float32 if p.dtype == torch.bfloat16 else p.dtype
            if g is not None and self._as_rows(g):
                g = g.coalesce()
                mine = g.indices()[0].cpu().numpy(), g.values().detach().to("cpu", wire).numpy()
            else:
                mine = no_rows(p.shape, torch.empty(0, dtype=wire).numpy().dtype)
            indices, values = self.averager.gather_rows(*mine)
            sparse = torch.sparse_coo_tensor(torch.from_numpy(indices).reshape(1, -1), torch.from_numpy(values),
                                             p.shape, check_invariants=True).to(p.device, p.dtype).coalesce()
            p.grad = sparse if dense_part is None else dense_part.add_(sparse)

    def shadow(self) -> None:
        """Take part in one step with zero gradients (a rank that has run out of data)."""
        for flat in self.flat:
            flat.zero_()
        handles = [self._reduce_async(b) for b in range(len(self.flat))]
        for b, h in enumerate(handles):
            self.apply(b, h.wait())
        self._gather_rows(contribute=False)
        self.averager.count_step()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks."""
        for h in self.hooks:
            h.remove()
        self.hooks = []


def trainable_parameters(optimizer, named_parameters, comm) -> Tuple[List[torch.Tensor], List[str]]:
    """The optimizer's parameters that need gradients (each once, in group order) and their names.

    Names come from ``named_parameters`` (ValueError if one is missing there), else ``param<i>``.
    Every rank of ``comm`` must pass the same names, shapes and dtypes (else ValueError naming the ranks).
    """
    params: List[torch.Tensor] = []
    seen = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    by_id = {id(p): f"param{i}" for i, p in enumerate(params)} if named_parameters is None else {}
    for name, p in named_parameters or ():
        by_id.setdefault(id(p), name)
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's parameters "
                         f"(positions {missing[:10]}); pass model.named_parameters() of the model "
                         f"whose parameters the optimizer updates")
    names = [by_id[id(p)] for p in params]
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(names, params)]
    check_same(comm, "the parameters given to DistributedOptimizer (name, shape, dtype)",
               shapes, f"{len(shapes)} parameters, first differences: {shapes[:3]}")
    return params, names


class _HostStaged:
    """One bucket through the compressor, via a float32 host copy when the bucket is on a GPU or in bfloat16."""

    def __init__(self, averager: GradientAverager, flat: torch.Tensor, bucket, names, shapes):
        self.flat = flat
        staged = flat.device.type != "cpu" or flat.dtype not in (torch.float32, torch.float64, torch.float16)
        self.host = flat.detach().to("cpu", torch.float32, copy=True) if staged else None
        source = self.host if staged else flat.detach()
        self.pending = averager.start_bucket(source.numpy(), bucket, names, shapes)

    def test(self) -> bool:
        return self.pending.test()

    def wait(self, timeout: Optional[float] = None) -> torch.Tensor:
        """The reduced bucket (a :class:`~hpctrain.comm.call.handle.Waitable`: TimeoutError when ``timeout``
        seconds pass first)."""
        self.pending.wait(timeout)
        if self.host is not None:
            self.flat.copy_(self.host)
        return self.flat
