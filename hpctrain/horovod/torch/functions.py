"""Horovod's state helpers for torch: broadcast_parameters, broadcast_optimizer_state, object collectives.

They reuse :mod:`hpctrain.torch.state_broadcast` over a negotiated
communicator.  ``broadcast_optimizer_state`` first initialises an optimizer
that has never stepped, as Horovod's does: every parameter without a
gradient gets a zero gradient and the wrapped optimizer steps once (without
communicating), so that its state tensors exist to be overwritten.
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch

from ...torch import state_broadcast as native
from .. import requests
from ..basics import global_process_set
from ..negotiated import NegotiatedComm

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank: int = 0, process_set=global_process_set) -> None:
    """Copy ``root_rank``'s tensors into every rank's, in place.

    ``params``: ``model.state_dict()``, ``model.named_parameters()`` (or a list
    of ``(name, tensor)`` pairs), or ``model.parameters()``.
    """
    native.broadcast_parameters(params, root=requests.root_index(root_rank, process_set), comm=NegotiatedComm(process_set))


def broadcast_optimizer_state(optimizer, root_rank: int = 0, process_set=global_process_set) -> None:
    """Copy ``root_rank``'s optimizer state and hyper-parameters to every rank."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (as in Horovod)")
    if not optimizer.state_dict()["state"]:
        _initialise(optimizer)
    native.broadcast_optimizer_state(optimizer, root=requests.root_index(root_rank, process_set), comm=NegotiatedComm(process_set))


def _initialise(optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    sync = getattr(optimizer, "_hpctrain", None)
    if sync is None:
        optimizer.step()
        return
    cls = type(optimizer)
    plain = next(c for c in cls.__mro__ if c.__module__.startswith("torch.optim") and
                 issubclass(c, torch.optim.Optimizer))
    plain.step(optimizer)
    sync.reset()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Return ``root_rank``'s picklable ``obj`` on every rank."""
    return requests.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: Optional[str] = None, process_set=global_process_set) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order."""
    return requests.allgather_object(obj, name, process_set)
