"""Local SGD and DiLoCo for torch: the rule of :mod:`hpctrain.optim.local_sgd` on a DistributedOptimizer.

During the warm-up the gradients are averaged as by :func:`DistributedOptimizer`
(buckets reduced during backward); after it the buckets' reduction is a
strategy on the bucket-reduction hook that sends nothing, each rank steps on
its own gradients, and every ``sync_every`` steps a post-step hook hands the
flat parameters to the core's outer step and copies the result back.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from ..comm.handle import done_handle
from ..optim.local_sgd import LocalSGD, OuterNesterov
from .flat import flatten, unflatten_into
from .optimizer import DistributedOptimizer

__all__ = ["LocalSGDOptimizer"]


def LocalSGDOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Optional[Iterable] = None,
                      sync_every: int = 16, warmup_steps: int = 0, outer_lr: Optional[float] = None,
                      outer_momentum: float = 0.9, compression=None, bucket_mb: float = 25,
                      comm=None, sync_every_s: Optional[float] = None) -> torch.optim.Optimizer:
    """Make ``optimizer`` train with local SGD, or DiLoCo with ``outer_lr``: the ranks meet every ``sync_every`` steps.

    Rule and cost: :mod:`hpctrain.optim.local_sgd`.  The optimizer object is
    returned as a :func:`DistributedOptimizer` (its class swapped), with the
    core as ``optimizer.local_sgd`` (its ``steps``, ``syncs``, ``state_dict``).
    Broadcast the initial parameters first (:func:`broadcast_parameters`):
    the global copy is taken from them here.

    Args:
        optimizer: the inner optimizer (DiLoCo: AdamW, lr 4e-4, weight decay 0.1, betas (0.9, 0.95)).
        named_parameters: ``model.named_parameters()`` (names in errors).
        sync_every: H, the local steps between outer steps.
        warmup_steps: synchronous steps first (gradients averaged each step).
        outer_lr: None for plain periodic averaging; else the outer SGD-Nesterov
            step on the averaged delta with this learning rate (DiLoCo: 0.7).
        outer_momentum: its momentum (DiLoCo: 0.9).
        compression: a compressor (or its name) for the delta of the outer step.
        bucket_mb: the warm-up's gradient buckets.
        comm: the communicator (default: the world; local SGD does not follow a re-formed world).
        sync_every_s: rounds of this many seconds instead of ``sync_every`` steps: a fast rank does more
            local steps than a straggler; stop the training loop on ``optimizer.local_sgd.global_steps``
            (every rank's steps, the same on every rank after each outer step).
    """
    opt = DistributedOptimizer(optimizer, named_parameters, bucket_mb=bucket_mb,
                               comm=comm if comm is not None else _world())
    outer = OuterNesterov(outer_lr, outer_momentum) if outer_lr is not None else None
    sync = opt._hpctrain
    local = LocalSGD(sync.averager.comm, sync_every, warmup_steps, outer, compression, sync_every_s)
    averaging = sync.averager

    def reduce_bucket(comm, flat, bucket, op):
        """The bucket-reduction strategy: averaged during the warm-up, kept local after it."""
        if local.synchronous and comm.size > 1:
            return comm.allreduce_async(flat, op=op, inplace=True)
        return done_handle(flat)

    averaging.bucket_hook = reduce_bucket
    params = [p for group in opt.param_groups for p in group["params"]]
    local.start(flatten(params).numpy())

    def after_step(_opt, args, kwargs):
        todo = local.step_done()
        if todo:
            flat = flatten(params)
            local.after_step(todo, flat.numpy())
            unflatten_into(flat, params)

    opt.register_step_post_hook(after_step)
    opt.local_sgd = local
    return opt


def _world():
    from ..world import world

    return world()
