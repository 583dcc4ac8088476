"""Node structure of an MPI communicator: the ranks that share memory, and a shared arena for them.

``HPCTRAIN_RANKS_PER_NODE=k`` pretends that world ranks ``0..k-1``, ``k..2k-1``,
... are nodes, so that the multi-node (hierarchical) paths run on one machine;
the "nodes" still share memory, which the arena needs.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from .... import settings

__all__ = ["NodeGroups", "SharedArena", "SharedBuffer", "shared_window", "release_window"]

def _fake_node_size() -> Optional[int]:
    return settings.get("HPCTRAIN_RANKS_PER_NODE") or None


class NodeGroups:
    """The node sub-communicator of ``comm``, where this rank sits, and the cross-node ring group.

    Attributes:
        local_rank, local_size: position on the node.
        node_rank, num_nodes: index of the node among the nodes of ``comm``.
        parts: the smallest local size of any node: the number of segments a
            hierarchical all-reduce splits a buffer into.
        node: the MPI communicator of this node's ranks.
        cross: for local ranks below ``parts`` on several nodes, the MPI
            communicator of the ranks with the same local rank (one per node,
            in node order); else None.

    Collective over ``comm`` (two splits and two small all-gathers).
    """

    def __init__(self, comm, world_rank: int, MPI):
        k = _fake_node_size()
        if k is None:
            self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        else:
            self.node = comm.Split(world_rank // k, comm.Get_rank())
        self.local_rank, self.local_size = self.node.Get_rank(), self.node.Get_size()
        leaders = comm.allgather(self.local_size if self.local_rank == 0 else 0)
        sizes = [s for s in leaders if s]
        self.num_nodes, self.parts = len(sizes), min(sizes)
        first = self.node.bcast(comm.Get_rank() if self.local_rank == 0 else None, root=0)
        self.node_rank = sum(1 for s in leaders[:first] if s)
        color = self.local_rank if self.num_nodes > 1 and self.local_rank < self.parts else MPI.UNDEFINED
        cross = comm.Split(color, comm.Get_rank())
        self.cross = None if cross == MPI.COMM_NULL else cross
        self._MPI = MPI

    def free(self) -> None:
        """Free the node and cross communicators."""
        for c in (self.node, self.cross):
            if c is not None and c != self._MPI.COMM_NULL:
                c.Free()
        self.node = self.cross = None


def shared_window(node, MPI, nbytes: int):
    """Allocate ``nbytes`` per local rank in one MPI-3 shared window (collective over ``node``), locked for access.

    Returns the window and each local rank's memory as a buffer.
    """
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")
    try:
        win = MPI.Win.Allocate_shared(nbytes, 1, info, comm=node)
    finally:
        info.Free()
    win.Lock_all(MPI.MODE_NOCHECK)
    return win, [win.Shared_query(k)[0] for k in range(node.Get_size())]


def _window_fence(win, node) -> None:
    """Return when every local rank has arrived, with their writes to ``win`` visible (MPI_Win_sync + barrier)."""
    win.Sync()
    node.Barrier()
    win.Sync()


def release_window(win) -> None:
    win.Unlock_all()
    win.Free()


class SharedArena:
    """Per-rank input and result areas in one MPI-3 shared window of the node (see :mod:`hpctrain.collectives.shm`).

    The window is allocated on first use and reallocated (collectively: every
    local rank asks for the same size, because every rank runs the same call)
    when a call needs more; sizes grow by powers of two so that a run with
    varying sizes reallocates a few times at most.  ``limit_bytes``
    (``HPCTRAIN_SHM_ARENA_BYTES``) bounds the piece one all-reduce pass handles.
    """

    def __init__(self, node, MPI, limit_bytes: int):
        self._node, self._MPI = node, MPI
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self._win = None
        self._capacity = 0
        self._bases: List[memoryview] = []
        self._last_key: Optional[tuple] = None
        self._last_views: List[Tuple[np.ndarray, np.ndarray]] = []
        self._limit = limit_bytes

    def max_elems(self, itemsize: int) -> int:
        """Return the most elements of ``itemsize`` bytes one all-reduce piece should take (input + result)."""
        return max(1, self._limit // (2 * itemsize))   # input and result halves

    def _grow(self, nbytes: int) -> None:
        MPI = self._MPI
        cap = 1 << max(16, (nbytes - 1).bit_length())
        self.free()
        self._win, self._bases = shared_window(self._node, MPI, cap)
        self._capacity = cap

    def views(self, n_in: int, n_res: int, dtype) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Return ``(input[n_in], result[n_res])`` views of ``dtype`` for every local rank (collective when growing).

        Inputs start at the beginning of each rank's part of the window and
        results at its middle, whatever the sizes: an area of one call never
        overlaps the other kind of area of the next call, which the two fences
        per call rely on.
        """
        dtype = np.dtype(dtype)
        key = (n_in, n_res, dtype.str, self._capacity)
        if key == self._last_key:              # a training loop repeats the same sizes
            return self._last_views
        need = max(n_in, n_res) * dtype.itemsize
        if 2 * need > self._capacity:
            self._grow(2 * need)
        half = self._capacity // 2
        views = [(np.frombuffer(base, dtype=dtype, count=n_in),
                  np.frombuffer(base, dtype=dtype, count=n_res, offset=half)) for base in self._bases]
        self._last_key, self._last_views = (n_in, n_res, dtype.str, self._capacity), views
        return views

    def fence(self) -> None:
        """Return when every local rank has arrived, with their writes visible (MPI_Win_sync + barrier)."""
        _window_fence(self._win, self._node)

    def free(self) -> None:
        """Release the window (collective over the node)."""
        if self._win is not None:
            self._bases, self._last_key, self._last_views = [], None, []
            release_window(self._win)
            self._win, self._capacity = None, 0


class SharedBuffer:
    """One buffer per local rank in an MPI-3 shared window: each rank's own, and views of its peers'.

    Made by :meth:`hpctrain.comm.backends.mpi.MPIBackend.shared_empty` (collective
    over the node).  An in-place all-reduce of the own buffer then runs
    without copying it anywhere first (see
    :func:`hpctrain.collectives.shm.shm_allreduce_shared_buffer`).
    """

    def __init__(self, node, MPI, count: int, dtype):
        self.dtype, self.count = np.dtype(dtype), int(count)
        nbytes = max(1, self.count * self.dtype.itemsize)
        self._node = node
        self._win, bases = shared_window(node, MPI, nbytes)
        self.rank = node.Get_rank()
        self.arrays = [np.frombuffer(base, dtype=self.dtype, count=self.count) for base in bases]
        self.own = self.arrays[self.rank]

    def fence(self) -> None:
        """Return when every local rank has arrived, with their writes to the buffers visible."""
        _window_fence(self._win, self._node)

    def free(self) -> None:
        """Release the window (collective over the node); the arrays must not be used afterwards."""
        if self._win is not None:
            self.arrays, self.own = [], None
            release_window(self._win)
            self._win = None
