"""hpctrain: data- and hybrid-parallel training over MPI and Horovod, for PyTorch and TensorFlow.

Quick start::

    import hpctrain
    comm = hpctrain.init()                 # mpirun / srun / horovodrun / plain python
    y = hpctrain.allreduce(x, op="avg")    # numpy, torch or TensorFlow tensors

Every collective is a module function on the world communicator and a method
of any communicator (``comm.split(color, key)`` makes sub-communicators); each
has an ``_async`` twin that returns a handle with ``wait()`` and ``test()``.
Importing hpctrain imports no framework and no MPI, and prints nothing.
"""
from __future__ import annotations

import functools
import inspect

from .comm.base import Communicator, Handle, Topology
from .errors import (BackendUnavailableError, CollectiveMismatchError, HpctrainError,
                     NotInitializedError)
from .world import init, is_initialized, shutdown, world

__version__ = "0.1.0"

_COLLECTIVES = (
    "allreduce", "grouped_allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall", "barrier",
    "send", "recv", "broadcast_object", "allgather_object",
)

__all__ = [
    "__version__", "init", "shutdown", "is_initialized", "world",
    "rank", "size", "local_rank", "local_size", "node_rank", "num_nodes",
    "Communicator", "Handle", "Topology",
    "HpctrainError", "CollectiveMismatchError", "NotInitializedError", "BackendUnavailableError",
] + [name for c in _COLLECTIVES for name in (c, c + "_async")]


def rank() -> int:
    """Return this process's rank in the world."""
    return world().rank


def size() -> int:
    """Return the number of ranks in the world."""
    return world().size


def local_rank() -> int:
    """Return this process's rank among the ranks on its node."""
    return world().topology.local_rank


def local_size() -> int:
    """Return the number of ranks on this process's node."""
    return world().topology.local_size


def node_rank() -> int:
    """Return the index of this process's node."""
    return world().topology.node_rank


def num_nodes() -> int:
    """Return the number of nodes in the world."""
    return world().topology.num_nodes


def _on_world(name: str):
    method = getattr(Communicator, name)

    @functools.wraps(method)
    def call(*args, **kwargs):
        return getattr(world(), name)(*args, **kwargs)

    sig = inspect.signature(method)
    call.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    call.__qualname__ = name
    call.__module__ = __name__
    return call


for _name in _COLLECTIVES:
    globals()[_name] = _on_world(_name)
    globals()[_name + "_async"] = _on_world(_name + "_async")
del _name
