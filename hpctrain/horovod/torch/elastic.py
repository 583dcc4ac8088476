"""``hvd.elastic`` of ``hpctrain.horovod.torch``: Horovod's ``run``, ``TorchState`` and ``ElasticSampler``.

See :mod:`hpctrain.horovod.elastic` for how a reset works here and what
differs from Horovod.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ...elastic.sampler import ElasticSampler as _CoreSampler
from ...torch.elastic_state import TorchState as _CoreTorchState
from ..elastic import ObjectState, State, run
from .functions import broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]


class TorchState(State, _CoreTorchState):
    """Horovod's ``TorchState(model=None, optimizer=None, **kwargs)``: the model's and the optimizer's state,
    and named values (``state.epoch``), saved by ``commit()`` and broadcast from rank 0 by ``sync()``."""

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **values: Any):
        self._track_hosts()
        _CoreTorchState.__init__(self, model, optimizer, **values)

    def _sync(self, comm) -> None:
        model, optimizer = getattr(self, "model", None), getattr(self, "optimizer", None)
        if model is not None:
            broadcast_parameters(model.state_dict(), root_rank=0)
        if optimizer is not None:
            broadcast_optimizer_state(optimizer, root_rank=0)
        self._sync_values(comm, ("model", "optimizer"))


class ElasticSampler(_CoreSampler, torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler(dataset, shuffle=True, seed=0)``: this rank's share of the epoch's samples not
    yet processed, dealt anew over the world after a reset (the last share padded with the epoch's head, as
    Horovod does).  Keep it in the ``TorchState``; ``record_batch(batch_idx, batch_size)`` after each batch,
    ``set_epoch(epoch)`` at each epoch's end."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        _CoreSampler.__init__(self, len(dataset), shuffle=shuffle, seed=seed, drop_last=False)
        self.dataset = dataset

    def record_batch(self, batch_idx: int, batch_size: int) -> None:         # noqa: D102 - Horovod's signature
        _CoreSampler.record_batch(self, batch_size)

    @property
    def processed_num(self) -> int:
        """Samples of this epoch processed by the world (Horovod's name)."""
        return self.processed

    def reset(self) -> None:
        """Nothing to do: the world's rank and size are read at each ``__iter__``."""
