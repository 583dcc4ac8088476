"""Horovod's ``hvd.DistributedOptimizer`` on hpctrain's gradient machinery.

The optimizer is :func:`hpctrain.torch.DistributedOptimizer` (buckets filled
by autograd hooks, reductions overlapping backward, has-gradient flags so
ranks may leave different parameters unused, sparse-gradient policy, error
feedback for compressors) over a :class:`~hpctrain.horovod.negotiated.NegotiatedComm`,
so its reductions are negotiated like every other Horovod request.  Horovod's
arguments map as :mod:`hpctrain.horovod.gradient_args` says; besides,
``num_groups``/``groups`` set how many fused reductions a step uses (the
gradients are split into that many buckets of about equal bytes).
"""
from __future__ import annotations

import warnings

from ...torch.class_swap import subclass_with
from ...torch.optimizer import DistributedOptimizer as _native
from ...torch.optimizer import rebuild_on
from .. import basics
from ..basics import Average, global_process_set
from ..negotiated import NegotiatedComm
from ..gradient_args import gradient_settings
from .compression import Compression

__all__ = ["DistributedOptimizer"]


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0, num_groups=0,
                         groups=None, sparse_as_dense=False, process_set=global_process_set):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (or summed) over the ranks.

    Returns the same optimizer object, its class changed to a subclass of its
    own (see :func:`hpctrain.torch.DistributedOptimizer`).
    """
    named = _check_names(optimizer, named_parameters)
    settings = gradient_settings(compression, op, gradient_predivide_factor, process_set)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    total = sum(p.numel() * p.element_size() for p in params)
    count = len(groups) if groups is not None and not isinstance(groups, int) else (groups or num_groups or 0)
    if groups is not None and not isinstance(groups, int):
        listed = {id(p) for g in groups for p in g}
        if not listed <= {id(p) for p in params}:
            raise ValueError("groups must list parameters of the optimizer")
    bucket_mb = max(total / count, 1) / 2 ** 20 if count else 25
    opt = _native(optimizer, named_parameters=named, compression=settings.compressor,
                  op=settings.op, backward_passes_per_step=backward_passes_per_step,
                  bucket_mb=bucket_mb, comm=settings.comm, sparse_as_dense=sparse_as_dense)
    if settings.op != "adasum" and process_set is global_process_set and basics.controller().world.life.failure_policy.reforms:
        _follow_resets(opt, (settings.op, settings.compressor, None, sparse_as_dense), backward_passes_per_step,
                       int(bucket_mb * 2 ** 20))
    opt._parameter_names = {p: n for n, p in named} if named else {
        p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
    opt.__class__ = subclass_with(_HorovodMixin, type(opt), type(opt).__name__)
    return opt


def _follow_resets(optimizer, averaging: tuple, passes: int, cap_bytes: int) -> None:
    """After each reset of ``hvd.elastic.run`` (a re-formed world, Horovod initialised again), rebuild
    ``optimizer``'s buckets over the new negotiation (held weakly: a dropped optimizer stops following)."""
    basics.on_reset(lambda opt: rebuild_on(opt, NegotiatedComm(global_process_set), averaging, passes, cap_bytes),
                    owner=optimizer)


def _check_names(optimizer, named_parameters):
    if named_parameters is None:
        return None
    named = list(named_parameters)
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters has duplicate names: {dups[:5]}")
    unnamed = {id(p) for g in optimizer.param_groups for p in g["params"]} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError(f"named_parameters lacks {len(unnamed)} of the optimizer's parameters; pass "
                         f"model.named_parameters() of every model the optimizer updates")
    return named


class _HorovodMixin:
    """Horovod's warning for ``step()`` after an explicit ``synchronize()`` outside ``skip_synchronize()``."""

    def step(self, closure=None):
        sync = self._hpctrain
        if sync.synchronized and not sync.skip:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                          "your code.")
        return super().step(closure)

