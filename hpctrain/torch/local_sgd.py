"""Local SGD and DiLoCo for torch: the rule of :mod:`hpctrain.optim.local_sgd` on a DistributedOptimizer.

During the warm-up the gradients are averaged as by :func:`DistributedOptimizer`
(buckets reduced during backward); after it the buckets' reduction is a
strategy on the bucket-reduction hook that sends nothing, each rank steps on
its own gradients, and every ``sync_every`` steps a post-step hook hands the
flat parameters to the core's outer step and copies the result back.

The optimizer's state spans the ranks (each rank's parameters and inner
optimizer state are its own between syncs): a checkpoint writes every rank's
part (``shard_state_dict``) and restores it at the same or another world size
(``load_shard_state_dict``, the rule in :mod:`hpctrain.optim.local_sgd`),
putting each rank's own parameters back.  A plain state dict (``state_dict()``
of this rank, or of a plain optimizer) loads too; without the outer state in it
the global copy is taken again from the parameters at the next step.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch

from ..bucket_strategies import LocalSGDBuckets
from ..optim.local_sgd import LOCAL_SGD_FORMAT, LocalSGD, OuterNesterov
from .class_swap import subclass_with
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
    name = f"LocalSGD{type(optimizer).__name__}"
    comm = comm if comm is not None else _world()
    outer = OuterNesterov(outer_lr, outer_momentum) if outer_lr is not None else None
    local = LocalSGD(comm, sync_every, warmup_steps, outer, compression, sync_every_s)
    opt = DistributedOptimizer(optimizer, named_parameters, bucket_mb=bucket_mb, comm=comm,
                               bucket_strategy=LocalSGDBuckets(local))
    params = [p for group in opt.param_groups for p in group["params"]]
    local.start(flatten(params).numpy())

    def after_step(_opt, args, kwargs):
        todo = local.step_done()
        if todo:
            flat = flatten(params)
            local.after_step(todo, flat.numpy())
            unflatten_into(flat, params)

    def before_step(_opt, args, kwargs):
        if local.theta_g is None:       # (a plain state was loaded: the global copy is the parameters now)
            local.start(flatten(params).numpy())

    opt.register_step_pre_hook(before_step)
    opt.register_step_post_hook(after_step)
    opt.local_sgd = local
    opt.__class__ = subclass_with(_LocalSGDMixin, type(opt), name)
    return opt


class _LocalSGDMixin:
    """The state methods of a LocalSGDOptimizer: its state spans the ranks (module docstring)."""

    local_sgd: LocalSGD
    hpctrain_state_spans_ranks = True
    hpctrain_state_format = LOCAL_SGD_FORMAT

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Nothing to gather: :meth:`state_dict` is this rank's whole state (its own and the common part)."""

    def state_dict(self) -> dict:
        """This rank's inner optimizer state, with the local-SGD state under ``"local_sgd"``."""
        out = super().state_dict()
        out["local_sgd"] = self.local_sgd.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an inner optimizer state; its ``"local_sgd"`` part if present, else the global copy is taken from
        the parameters at the next step (a plain optimizer's state: start local SGD from it)."""
        state_dict = dict(state_dict)
        core = state_dict.pop("local_sgd", None)
        super().load_state_dict(state_dict)
        if core is not None:
            self.local_sgd.load_state_dict(core)
        else:
            self.local_sgd.theta_g = None
            self.local_sgd.synced_at = self.local_sgd.steps

    def shard_state_dict(self) -> tuple:
        """``(common, own)``: the global copy, outer momentum and counters alike on every rank; this rank's
        parameters, inner optimizer state and step counts."""
        whole = torch.optim.Optimizer.state_dict(self)
        common = {"format": LOCAL_SGD_FORMAT, "world": self.local_sgd.comm.size, "core": self.local_sgd.common_state(),
                  "param_groups": whole["param_groups"]}
        own = {"core": self.local_sgd.own_state(), "state": whole["state"], "params": flatten(self._params()).numpy()}
        return common, own

    def load_shard_state_dict(self, common: dict, read) -> None:
        """Go on from a state written by :meth:`shard_state_dict` at any world size (``read(rank)``: that rank's
        ``own``; the rule: :meth:`hpctrain.optim.local_sgd.LocalSGD.load_saved`)."""
        mine, own = self.local_sgd.load_saved(common, read)
        torch.optim.Optimizer.load_state_dict(self, {"state": own["state"], "param_groups": common["param_groups"]})
        unflatten_into(torch.from_numpy(np.ascontiguousarray(mine)), self._params())


def _world():
    from ..world import world

    return world()
