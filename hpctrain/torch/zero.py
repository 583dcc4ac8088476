"""ShardedOptimizer: ZeRO stages 1 and 2 for torch, the optimizer state (and gradients) split over the ranks.

``optimizer = hpctrain.torch.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=...), stage=2)``
replaces :func:`~hpctrain.torch.DistributedOptimizer` (do not use both).
Per step (:mod:`hpctrain.optim.zero` for the layout):

* during backward, every bucket of gradients is reduce-scattered as it
  becomes ready (:class:`~hpctrain.torch.zero_sync.ZeroSync`): each rank
  receives the average of its own chunk only;
* ``step()`` runs the wrapped optimizer's own update on this rank's chunk of
  every bucket (a flat tensor per bucket; the state of the chunks is the only
  optimizer state this rank holds: ``1/N`` of it);
* the updated chunks are all-gathered into the parameters, so every rank
  holds the whole model again for the next forward pass.

Same results as :func:`~hpctrain.torch.DistributedOptimizer` with the same
optimizer: the update is applied element by element on the same averaged
gradients (bit for bit where the reduce-scatter sums in the all-reduce's
order).  That is why the optimizer must be element-wise (SGD, Adam, AdamW,
Adagrad, RMSprop, ...): a chunk cuts across parameters, so per-tensor norms
(LAMB, LARS) would be wrong.  A parameter for which no rank had a gradient
keeps its value and moments, as in the unsharded optimizer (its step counter
is its chunk's).

Stage 1 shards the optimizer state; each parameter's ``.grad`` stays the
local (not averaged) gradient.  Stage 2 also drops each parameter's
``.grad`` once its bucket is packed: gradient memory is ``1/N`` plus the
buckets in flight.  Cost per step: one reduce-scatter and one allgather of
the model's bytes (together those of one all-reduce), one copy of ``1/N`` of
the parameters into the chunks.

The wrapped optimizer keeps its param groups (learning-rate schedulers work
on them); its ``state`` stays empty.  ``consolidate_state_dict(to)`` then
``state_dict()`` give the whole state in the wrapped optimizer's own format
(a plain torch optimizer loads it); ``load_state_dict`` takes that format at
any world size (each rank keeps its chunks).  The checkpoint manager and the
elastic states do not gather: ``shard_state_dict()`` gives the layout and this
rank's chunks, which a checkpoint writes to the rank's shard file and an
elastic commit copies to a buddy rank; ``load_shard_state_dict`` reshards
them at any world size (:func:`hpctrain.optim.zero.reshard_copies`).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Dict, List, Optional

import torch

from ..optim.zero import per_element, refuse_compression
from . import zero_state
from .class_swap import subclass_with
from .optimizer import keep_patched_step
from .zero_sync import IN_FLIGHT, ZeroSync

__all__ = ["ShardedOptimizer", "ELEMENTWISE"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD",
               "Rprop")


def ShardedOptimizer(optimizer: torch.optim.Optimizer, stage: int = 2, named_parameters=None, bucket_mb: float = 25,
                     backward_passes_per_step: int = 1, comm=None, elementwise: Optional[bool] = None,
                     compression=None, overlap_allgather: bool = False):
    """Shard ``optimizer``'s state (stage 1) and gradients (stage 2) over the ranks of ``comm`` (ZeRO).

    The optimizer object itself is returned, its class changed (as
    :func:`~hpctrain.torch.DistributedOptimizer` does).  Create it on every
    rank over the same parameters, after broadcasting the initial parameters.

    Args:
        optimizer: a ``torch.optim.Optimizer`` with an element-wise update.
        stage: 1 (optimizer state sharded) or 2 (also the gradients).
        named_parameters: ``model.named_parameters()``, for error messages.
        bucket_mb: bucket size in MiB (the unit of the reduce-scatter).
        backward_passes_per_step: passes accumulated locally before the reduction (averaged).
        comm: the data-parallel communicator (default: the world; the layout's ``dp`` group with
            pipeline or tensor parallelism).
        elementwise: say the optimizer's update is element by element when its class is not one of
            torch's in :data:`ELEMENTWISE` (refused otherwise).
        compression: refused (hpctrain's compressors are defined for all-reduce, not reduce-scatter).
        overlap_allgather: ``step()`` only starts the allgathers (first layers' bucket first); each module
            waits for its parameters' bucket just before its next forward (a forward pre-hook), so the
            allgather overlaps that forward pass.  Costs up to one more copy of the parameters in flight;
            parameters read outside their module's forward (``model.state_dict()``, tied weights used by
            another module) need ``optimizer.wait_parameters()`` first.  Off by default.
    """
    from ..world import comm_or_world

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"ShardedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_hpctrain") or hasattr(optimizer, "_hpctrain_zero"):
        raise ValueError("this optimizer is already distributed (DistributedOptimizer or ShardedOptimizer): "
                         "wrap the plain torch optimizer once")
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (also gradients), got {stage!r}")
    refuse_compression(compression)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be a positive int, got {backward_passes_per_step!r}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    base = type(optimizer)
    known = base.__module__.startswith("torch.optim") and base.__name__ in ELEMENTWISE
    if not (known if elementwise is None else elementwise):
        raise ValueError(f"ShardedOptimizer steps on chunks that cut across parameters, so the update must be "
                         f"element by element; {base.__name__} is not one of torch's element-wise optimizers "
                         f"{ELEMENTWISE}: pass elementwise=True if its update is (no per-tensor norms)")
    cls = subclass_with(_ShardedMixin, base, f"Sharded{base.__name__}")
    sync = ZeroSync(optimizer, named_parameters, comm_or_world(comm), backward_passes_per_step,
                    int(bucket_mb * 2 ** 20), stage)
    optimizer.__class__ = cls
    optimizer._hpctrain_zero = _Shards(optimizer, base, sync, overlap_allgather)
    keep_patched_step(optimizer)
    if comm is None:
        from ..world import on_reform

        on_reform(lambda opt, world: _reshard_on(opt, world, base, backward_passes_per_step, int(bucket_mb * 2 ** 20)),
                  owner=optimizer)
    return optimizer


def _reshard_on(optimizer, world, base: type, passes: int, cap_bytes: int) -> None:
    """Shard ``optimizer`` anew over ``world`` (a re-formed world, elastic mode); its chunks start without state.

    The state comes back from the elastic commit being restored: every old
    rank's part, from its own copy or its buddy's (:mod:`hpctrain.checkpoint.peer_storage`),
    resharded by ``load_shard_state_dict``.
    """
    shards = optimizer._hpctrain_zero
    old = shards.sync
    old.remove_hooks()
    shards.drop_pending()           # (the old world's allgathers: the commit being restored has the values)
    sync = ZeroSync(optimizer, list(zip(old.names, old.params)), world, passes, cap_bytes, old.stage)
    optimizer._hpctrain_zero = _Shards(optimizer, base, sync, shards.overlap)


class _Shards:
    """This rank's chunks: flat tensors (padded to the chunk size), the inner optimizer over them, the allgather."""

    def __init__(self, outer: torch.optim.Optimizer, base: type, sync: ZeroSync, overlap: bool = False):
        self.sync, self.layout, self.comm, self.overlap = sync, sync.layout, sync.comm, bool(overlap)
        self.pending: Dict[int, object] = {}       # bucket -> its allgather in flight (overlap_allgather)
        self.bucket_of = {id(sync.params[i]): b for b, bk in enumerate(sync.buckets) for i in bk.members}
        self._hook = None
        self.padded: List[torch.Tensor] = []
        self.chunks: List[torch.Tensor] = []
        for b, bucket in enumerate(sync.buckets):
            dtype, device, _ = bucket.kind
            self.padded.append(torch.zeros(self.layout.chunks[b], dtype=dtype, device=device))
            self.chunks.append(self.padded[b][:self.layout.own_numel(b)])
        self.parts = [[(i, *self.layout.own_parts(b, off, n)) for i, off, n in zip(bk.members, bk.offsets, bk.numels)]
                      for b, bk in enumerate(sync.buckets)]
        self.group_of_inner = sorted(set(sync.group))
        groups = [{**_hyper(outer.param_groups[g]),
                   "params": [self.chunks[b] for b in range(len(self.chunks)) if sync.group[b] == g]}
                  for g in self.group_of_inner]
        accepted = inspect.signature(base.__init__).parameters       # (defaults may hold more than __init__ takes)
        self.inner = base(groups, **{k: v for k, v in outer.defaults.items() if k in accepted}) if groups else None
        self.consolidated: Optional[dict] = None
        self.consolidated_for = -1
        self.steps = 0

    def load_chunks(self) -> None:
        """Copy this rank's part of the parameters into its chunks (the parameters may have been loaded since)."""
        with torch.no_grad():
            for b, parts in enumerate(self.parts):
                for i, lo, hi, plo, phi in parts:
                    if lo < hi:
                        self.chunks[b][lo:hi].copy_(self.sync.params[i].detach().reshape(-1)[plo:phi])

    def step(self, outer_groups) -> None:
        """Step the chunks on their reduced gradients, then all-gather them into the parameters."""
        sync = self.sync
        self.wait_parameters()
        self.load_chunks()
        if self.inner is not None:
            for inner_group, g in zip(self.inner.param_groups, self.group_of_inner):
                inner_group.update(_hyper(outer_groups[g]))
            for b, chunk in enumerate(self.chunks):
                chunk.grad = sync.shard_grads[b]
            kept = self._keep_without_grad()
            self.inner.step()
            self._put_back(kept)
            for chunk in self.chunks:
                chunk.grad = None
        sync.shard_grads = [None] * len(self.chunks)
        self.allgather()
        self.steps += 1

    def _keep_without_grad(self) -> list:
        """Copies of the ranges of the chunks (and their state) where no rank had a gradient."""
        kept = []
        for b, ranges in enumerate(self.sync.without_grad):
            if ranges:
                chunk, state = self.chunks[b], self.inner.state.get(self.chunks[b], {})
                moments = {k: v for k, v in state.items() if per_element(k, v, chunk.shape)}
                kept.append((b, [(lo, hi, chunk[lo:hi].clone(), {k: v[lo:hi].clone() for k, v in moments.items()})
                                 for lo, hi in ranges]))
        return kept

    def _put_back(self, kept: list) -> None:
        with torch.no_grad():
            for b, ranges in kept:
                chunk, state = self.chunks[b], self.inner.state.get(self.chunks[b], {})
                for lo, hi, value, moments in ranges:
                    chunk[lo:hi].copy_(value)
                    for k, v in state.items():
                        if per_element(k, v, chunk.shape):
                            v[lo:hi].copy_(moments[k]) if k in moments else v[lo:hi].zero_()

    def allgather(self) -> None:
        """Every rank's chunks into every parameter: one allgather per bucket, at most ``IN_FLIGHT`` at once (each
        result, the bucket's size, is dropped once copied into the parameters).  With ``overlap`` only started
        (the last bucket first: the first layers' parameters), finished by :meth:`wait_parameters` or module by
        module just before their forward."""
        if self.overlap:
            for b in reversed(range(len(self.padded))):
                self.pending[b] = self.comm.allgather_async(self.padded[b])
            if self._hook is None and self.pending:
                self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)
            return
        handles: dict = {}
        for b in range(len(self.padded) + IN_FLIGHT):
            if b < len(self.padded):
                handles[b] = self.comm.allgather_async(self.padded[b])
            done = b - IN_FLIGHT
            if done >= 0:
                self._unpack(done, handles.pop(done).wait())

    def _unpack(self, b: int, flat) -> None:
        bucket = self.sync.buckets[b]
        with torch.no_grad():
            for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels):
                p = self.sync.params[i]
                p.copy_(flat[off:off + n].view_as(p))

    def _before_forward(self, module, args) -> None:
        """The forward pre-hook of overlap_allgather: finish the buckets of ``module``'s own parameters."""
        for p in module.parameters(recurse=False):
            b = self.bucket_of.get(id(p))
            if b in self.pending:
                self._unpack(b, self.pending.pop(b).wait())
        if not self.pending:
            self._release_hook()

    def wait_parameters(self) -> None:
        """Finish every allgather still in flight, so that every parameter holds this step's values."""
        while self.pending:
            b = next(iter(self.pending))
            self._unpack(b, self.pending.pop(b).wait())
        self._release_hook()

    def drop_pending(self) -> None:
        """Forget the allgathers in flight (their world failed) and the hook."""
        self.pending.clear()
        self._release_hook()

    def _release_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


class _ShardedMixin:
    """The methods a ShardedOptimizer adds to the wrapped optimizer's class."""

    _hpctrain_zero: _Shards
    hpctrain_state_spans_ranks = True       # (checkpoints and elastic states take it as per-rank parts)
    hpctrain_passes = "averaged"            # (gradients of passes accumulated in no_sync() are averaged)

    @property
    def stage(self) -> int:
        return self._hpctrain_zero.sync.stage

    def step(self, closure=None):
        """Finish the reduce-scatter, step this rank's chunks, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        zero = self._hpctrain_zero
        timeline = zero.comm.timeline
        span = timeline.span if timeline.on else (lambda *a: contextlib.nullcontext())
        with span("synchronize gradients", "torch"):
            if not zero.sync.skip:
                zero.sync.synchronize()
        with span("optimizer step", "torch"):
            zero.step(self.param_groups)
        zero.sync.reset()
        self._opt_called = True         # (what an LR scheduler's step counter marks)
        return loss

    def _around_step(self, local_step, closure=None):
        return self.step(closure)

    def synchronize(self) -> None:
        """Finish reduce-scattering the gradients now; ``step()`` then does not wait again."""
        self._hpctrain_zero.sync.synchronize()

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context backward passes only accumulate gradients locally (no communication)."""
        self._hpctrain_zero.sync.no_sync = True
        try:
            yield
        finally:
            self._hpctrain_zero.sync.no_sync = False

    @property
    def shard_comm(self):
        """The communicator whose ranks hold the chunks."""
        return self._hpctrain_zero.comm

    def wait_parameters(self) -> None:
        """With ``overlap_allgather``: finish the parameters' allgathers now (before reading the parameters
        outside a forward pass); otherwise nothing to do."""
        self._hpctrain_zero.wait_parameters()

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (every rank for None); collective."""
        zero_state.consolidate(self._hpctrain_zero, self, to)

    def state_dict(self) -> dict:
        """The whole state in the wrapped optimizer's format, after :meth:`consolidate_state_dict` on this rank."""
        zero = self._hpctrain_zero
        if zero.consolidated is None or zero.consolidated_for != zero.steps:
            raise RuntimeError(f"rank {zero.comm.rank}: call optimizer.consolidate_state_dict(to=...) on every rank "
                               "after the last step, then state_dict() on the rank it was gathered to")
        return zero.consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole state (this class's or a plain optimizer's of the same parameters), keeping this rank's chunks."""
        torch.optim.Optimizer.load_state_dict(self, {"state": {}, "param_groups": state_dict["param_groups"]})
        zero_state.load(self._hpctrain_zero, self, state_dict)

    def shard_state_dict(self) -> tuple:
        """``(common, own)``: the state as a checkpoint writes it, each rank its own chunks (no gathering)."""
        return zero_state.shard_state(self._hpctrain_zero, self)

    def load_shard_state_dict(self, common: dict, read) -> None:
        """Load a state written by :meth:`shard_state_dict` at any world size; ``read(rank)`` gives that rank's
        ``own`` (the checkpoint manager reads it from the rank's shard file)."""
        zero_state.load_shards(self._hpctrain_zero, self, common, read)

    def shard_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its chunks' state)."""
        inner = self._hpctrain_zero.inner
        if inner is None:
            return 0
        return sum(v.numel() * v.element_size() for st in inner.state.values() for v in st.values()
                   if torch.is_tensor(v))

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_hpctrain_zero", None) is not None:
            raise NotImplementedError("ShardedOptimizer: add parameter groups before wrapping the optimizer")
        super().add_param_group(param_group)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer then no longer communicates)."""
        self._hpctrain_zero.wait_parameters()
        self._hpctrain_zero.sync.remove_hooks()


_ShardedMixin.step.hooked = True        # (see hpctrain.torch.optimizer: torch must not wrap this step again)
