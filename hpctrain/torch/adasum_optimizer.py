"""``DistributedOptimizer(op="adasum")`` for torch: a local step, then Adasum of the parameter deltas.

The rule and its cost are :mod:`hpctrain.adasum_updates`'s.  Here ``step()``
snapshots the parameters, runs the wrapped optimizer's own ``step`` on this
rank's gradients (accumulated by autograd over the backward passes since
the last step: summed, as Horovod's Adasum optimizer leaves them), and
writes ``start + adasum(deltas)`` back into every parameter.  Backward
passes never communicate, so ``no_sync`` changes nothing and
``synchronize()`` has nothing to do.  CUDA and bfloat16 parameters are
combined through a float32 host copy of their deltas.

The wrapped optimizer's state (momentum, Adam's moments) is each rank's own,
so a checkpoint writes every rank's (``shard_state_dict``) and a restore gives
each rank its own back; at another world size new rank ``r`` takes saved rank
``r mod N``'s.
"""
from __future__ import annotations

import contextlib
from typing import List

import numpy as np
import torch

from ..adasum_updates import AdasumUpdates
from ..checkpoint.spread import RANK_STATES_FORMAT
from .class_swap import subclass_with
from .gradient_sync import trainable_parameters

__all__ = ["wrap_adasum"]



def wrap_adasum(optimizer: torch.optim.Optimizer, named_parameters=None, comm=None, compression=None):
    """Change ``optimizer``'s class to one whose ``step()`` combines the ranks' deltas; return it.

    ``named_parameters``: the parameters' names for error messages.
    """
    updates = AdasumUpdates(comm, compression)
    params, names = trainable_parameters(optimizer, named_parameters, updates.comm)
    if not all(p.dtype.is_floating_point for p in params):
        raise TypeError("op='adasum' needs floating-point parameters")
    split = [name for name, p in zip(names, params) if getattr(p, "hpctrain_tp_size", 1) > 1]
    if split:
        raise ValueError(f"op='adasum' combines whole tensors by their dot products, and {split[0]!r} is a slice of "
                         f"one split over a tensor-parallel group ({len(split)} such parameters), whose Adasum would "
                         f"differ from the whole tensor's: use op='avg' with tensor parallelism (tp > 1)")
    base = type(optimizer)
    cls = subclass_with(_AdasumMixin, base, f"DistributedAdasum{base.__name__}")
    optimizer.__class__ = cls
    optimizer._hpctrain = _AdasumState(updates, params)
    return optimizer


class _AdasumState:
    """What one Adasum optimizer holds: the combiner, its parameters and the skip flag."""

    def __init__(self, updates: AdasumUpdates, params: List[torch.Tensor]):
        self.updates, self.params, self.comm = updates, params, updates.comm
        self.skip = self.no_sync = self.synchronized = False

    def reset(self) -> None:
        """Start a new step (nothing is kept between steps)."""


class _AdasumMixin:
    """The methods an Adasum DistributedOptimizer adds to the wrapped optimizer's class."""

    _hpctrain: _AdasumState
    hpctrain_passes = "summed"          # (as Horovod's Adasum optimizer: autograd's sum of the passes is stepped on)

    def synchronize(self) -> None:
        """Nothing to finish: with op='adasum' the parameters are combined in ``step()``."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        raise ValueError("skip_synchronize() does not apply to op='adasum': step() itself combines the ranks' "
                         "updates (as in Horovod's Adasum optimizer)")
        yield  # pragma: no cover

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes never communicate with op='adasum'; gradients accumulate until ``step()``."""
        yield

    def step(self, closure=None):
        """Step on this rank's gradients, then set every parameter to start + Adasum of the ranks' deltas."""
        return self._around_step(super().step, closure)

    def _around_step(self, local_step, closure=None):
        state = self._hpctrain
        if not state.updates.communicates:
            state.updates.count_step()
            return local_step(closure)
        with torch.no_grad():
            starts = [p.detach().clone() for p in state.params]
        loss = local_step(closure)
        with torch.no_grad():
            deltas = [_host(p.detach() - s) for p, s in zip(state.params, starts)]
            combined = state.updates.combine(deltas)
            for p, s, c in zip(state.params, starts, combined):
                p.copy_(s.add_(torch.from_numpy(c).to(s.device, s.dtype).view_as(s)))
        return loss

    hpctrain_state_spans_ranks = True
    hpctrain_state_format = RANK_STATES_FORMAT

    def consolidate_state_dict(self, to=0) -> None:
        """Nothing to gather: ``state_dict()`` is this rank's own state."""

    def shard_state_dict(self) -> tuple:
        """``(common, own)``: the param groups; this rank's own optimizer state (each rank's differs)."""
        whole = torch.optim.Optimizer.state_dict(self)
        return {"format": RANK_STATES_FORMAT, "world": self._hpctrain.comm.size,
                "param_groups": whole["param_groups"]}, {"state": whole["state"]}

    def load_shard_state_dict(self, common: dict, read) -> None:
        """Take this rank's own state back; at another world size saved rank ``rank mod N``'s."""
        comm = self._hpctrain.comm
        own = read(comm.rank % int(common["world"]))
        torch.optim.Optimizer.load_state_dict(self, {"state": own["state"], "param_groups": common["param_groups"]})

    def remove_hooks(self) -> None:
        """Nothing is hooked with op='adasum' (kept for the same interface)."""

    def compression_stats(self) -> dict:
        """Bytes of deltas sent, per step and in total (:meth:`AdasumUpdates.stats`)."""
        return self._hpctrain.updates.stats()


def _host(t: torch.Tensor) -> np.ndarray:
    """A numpy copy of ``t`` on the host (float32 for bfloat16 and float16)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.cpu().numpy()


# torch wraps a class's step to run the optimizer's hooks; the wrapped optimizer's own step runs them.
_AdasumMixin.step.hooked = True
