"""The backend's own library all-reduce ("native": MPI_Allreduce, Horovod's, or a copy at one rank).

Cost: whatever the library does; for MPI typically a ring or recursive
doubling, ``2 (n-1)/n`` of the bytes sent per rank for large buffers and
``log2 n`` steps for small ones.  It is the reference every other
algorithm's cost estimate is relative to (1.0), and what ``auto`` falls back
to where no other algorithm estimates itself cheaper.

Not fault tolerant across nodes: a rank killed inside a cross-node
``MPI_Allreduce`` leaves the survivors partial sums and no error under Open
MPI 5.0's han (its default there), and a stall under tuned; so a world that
re-forms after failures (elastic mode) runs hpctrain's own algorithms there
instead (``Algorithm.fault_tolerant``: ``doubling`` for small buffers, the
ring or ``hierarchical`` above), whose point-to-point messages fail loudly.
"""
from __future__ import annotations

import numpy as np

from .registry import Algorithm, register

__all__ = ["native_allreduce", "native_reduce_scatter"]


def native_allreduce(links, acc: np.ndarray, op: str) -> np.ndarray:
    """Return the library's all-reduce of the flat buffer ``acc`` (it may reuse ``acc``)."""
    return links.native(acc, op)


def native_reduce_scatter(links, acc: np.ndarray, bounds: np.ndarray, op: str) -> np.ndarray:
    """Return this rank's block ``bounds[rank]:bounds[rank+1]`` of the library's reduction of ``acc``."""
    return links.native_reduce_scatter(acc, np.diff(bounds).tolist(), op)


register(Algorithm("native", "allreduce", run=native_allreduce, reduce_scatter=native_reduce_scatter,
                   cost=lambda where, nbytes: 1.0, summary="the backend's library all-reduce", fault_tolerant=False))
