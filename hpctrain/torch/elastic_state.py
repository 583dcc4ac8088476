"""The elastic state of a torch training run: model, optimizer, RNG streams and any named values."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..checkpoint.rng import RNGState
from ..elastic.state import ObjectState
from .state_broadcast import broadcast_optimizer_state, broadcast_parameters

__all__ = ["TorchState"]


class TorchState(ObjectState):
    """:class:`~hpctrain.elastic.ObjectState` with a torch ``model`` and ``optimizer`` (either may be None).

    A commit copies the model's state dict (parameters and buffers), the
    optimizer's (moments, step counts) and this rank's RNG streams
    (:class:`~hpctrain.checkpoint.RNGState`: Python, numpy, torch) into host
    memory; :meth:`sync` broadcasts rank 0's tensors in one broadcast per
    dtype (not pickled) and its other values as one object; the RNG streams
    stay each rank's own.  Cost of a commit: one copy of the model and the
    optimizer state.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **values: Any):
        for name in ("model", "optimizer", "rng"):
            if name in values:
                raise ValueError(f"TorchState: {name!r} is a name of its own; pick another for that value")
        tensors = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        super().__init__(local=("rng",), rng=RNGState(), **tensors, **values)

    def _sync(self, comm) -> None:
        model, optimizer = getattr(self, "model", None), getattr(self, "optimizer", None)
        if model is not None:
            broadcast_parameters(model.state_dict(), root=0, comm=comm)
        if optimizer is not None and not getattr(optimizer, "hpctrain_state_spans_ranks", False):
            broadcast_optimizer_state(optimizer, root=0, comm=comm)     # (a sharded one: each rank its own chunks)
        self._sync_values(comm, ("model", "optimizer"))
