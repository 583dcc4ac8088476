"""Uneven inputs: ranks that run out of data keep taking part until every rank is done."""
from __future__ import annotations

import numpy as np

from .optimizer import _DistributedMixin

__all__ = ["Join"]


class Join:
    """Let ranks with fewer batches finish the loop without hanging the others.

    Wrap the training loop::

        with hpctrain.torch.Join(optimizer):
            for batch in loader:          # ranks may have different numbers of batches
                ...; loss.backward(); optimizer.step()

    Inside the context every step starts with a one-element all-reduce that
    counts the ranks still training.  A rank that leaves the loop waits in
    ``__exit__`` and, for every step the others still take, contributes zero
    gradients to the same all-reduces and applies the same averaged update, so
    all replicas stay identical.  Gradients are averaged over the world size
    (a joined rank counts as a zero contribution, as in Horovod's ``join``).

    Cost: one extra 8-byte all-reduce per step, overlapped with backward.
    Limits: inside the context, the per-step collectives must be the
    optimizer's (no metric all-reduce, no SyncBatchNorm, per step); a
    learning-rate scheduler is not stepped on a rank while it waits.

    Args:
        optimizer: the :func:`~hpctrain.torch.DistributedOptimizer` of the loop.
    """

    def __init__(self, optimizer):
        if getattr(optimizer, "_hpctrain", None) is not None and not isinstance(optimizer, _DistributedMixin):
            raise ValueError("Join does not support op='adasum' (a rank out of data has no update to combine)")
        if not isinstance(optimizer, _DistributedMixin):
            raise TypeError("Join needs an optimizer made by hpctrain.torch.DistributedOptimizer")
        self.optimizer = optimizer
        self.sync = optimizer._hpctrain
        self.steps_joined = 0   # steps this rank shadowed after running out of data

    def __enter__(self) -> "Join":
        self.sync.join_flag = True
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if kind is not None:  # an error: let it propagate (hpctrain's excepthook ends the job)
            self.sync.join_flag = False
            return False
        try:
            sync, comm = self.sync, self.sync.comm
            if sync.launched or sync.synchronized:
                raise RuntimeError("Join ended with gradients sent but optimizer.step() not called")
            while comm.allreduce(np.zeros(1, dtype=np.int64))[0] > 0:
                sync.shadow()
                with self.optimizer.skip_synchronize():
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.steps_joined += 1
        finally:
            self.sync.join_flag = False
        return False
