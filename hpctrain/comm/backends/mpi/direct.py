"""Direct copies between the ranks of one node for large all-reduces (the MPI backend's use of cross_memory.py).

Where the kernel lets the ranks of a node read and write each other's private
memory (:class:`~hpctrain.comm.backends.mpi.cross_memory.CrossMemory`), a one-node
all-reduce of ``DIRECT_MIN_BYTES`` or more skips the shared arena:
:func:`~hpctrain.collectives.shm.shm_allreduce_direct` has each rank read its
segment of every peer's input and write the reduced segment into every
peer's output, the memory traffic of one memcpy instead of about 2.5 (same
bits as the arena).  Cost per call: one all-gather of the buffers' addresses
and one barrier over the node.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np

from ....collectives.flat import Flat
from ....collectives.shm import shm_allreduce_direct
from .cross_memory import CrossMemory
from .mailbox import cores_per_rank_at_least_one

__all__ = ["DirectCopies", "DIRECT_MIN_BYTES", "DIRECT_MIN_BYTES_OVERSUBSCRIBED"]

# From these sizes on, a one-node all-reduce copies straight between the ranks' memory where it can: below
# them the arena wins, its extra passes staying in cache and its system calls fewer (measured with
# benchmarks/allreduce.py, peers hpctrain-auto and hpctrain-auto-arena; the crossover is later when ranks
# outnumber cores).  Constants, not settings: the ranks of a node agree on one of them when they probe.
DIRECT_MIN_BYTES = 8 << 20
DIRECT_MIN_BYTES_OVERSUBSCRIBED = 16 << 20


class DirectCopies:
    """Whether, and from which size, the ranks of a node copy straight between each other's memory.

    Args:
        nodes: the communicator's :class:`~hpctrain.comm.backends.mpi.node.NodeGroups` (one node).
        MPI: the ``mpi4py.MPI`` module.
        runtime: the communicator's runtime; its ``config.cross_memory`` is read when probing.
    """

    def __init__(self, nodes, MPI, runtime):
        self._nodes, self._MPI, self._rt = nodes, MPI, runtime
        self._probed: Optional[tuple] = None   # (CrossMemory, local pids, min bytes) once probed; () if unusable

    @property
    def usable(self) -> Optional[bool]:
        """True or False once probed (see :meth:`min_bytes`), None before."""
        return None if self._probed is None else bool(self._probed)

    def min_bytes(self) -> Optional[int]:
        """Return the size from which to copy directly, or None where the node cannot.

        Probed on first use, collectively over the node: every rank reads a
        word from the next local rank's memory, and one all-reduce makes them
        agree on whether to copy directly (HPCTRAIN_CROSS_MEMORY=0 on any rank
        turns it off on all) and from which size (the larger threshold if any
        rank shares its cores with more ranks).
        """
        if self._probed is None:
            g, why, xm = self._nodes, "", None
            if not self._rt.config.cross_memory:
                why = "HPCTRAIN_CROSS_MEMORY=0"
            else:
                try:
                    xm = CrossMemory()
                except OSError as exc:
                    why = str(exc)
            word = np.array([os.getpid()], dtype=np.int64)
            table = np.empty((g.local_size, 2), dtype=np.int64)
            g.node.Allgather(np.array([os.getpid(), word.ctypes.data], dtype=np.int64), table)
            if xm is not None:
                pid, address = (int(v) for v in table[(g.local_rank + 1) % g.local_size])
                got = np.zeros(1, dtype=np.int64)
                try:
                    xm.read(pid, [(address, word.nbytes)], got)
                    why = "" if got[0] == pid else f"read {got[0]} from process {pid} instead of its pid"
                except OSError as exc:
                    why = str(exc)
            own = DIRECT_MIN_BYTES if cores_per_rank_at_least_one(g.local_size) else DIRECT_MIN_BYTES_OVERSUBSCRIBED
            agreed = np.empty(2, dtype=np.int64)                  # (after every read of ``word``)
            g.node.Allreduce(np.array([bool(why), own], dtype=np.int64), agreed, op=self._MPI.MAX)
            self._probed = (xm, table[:, 0].tolist(), int(agreed[1])) if not agreed[0] else ()
        return self._probed[2] if self._probed else None

    def allreduce(self, x: Flat, out: Flat, op: str, who: str, divisor: int = 1) -> None:
        """All-reduce ``x`` into ``out``, divided by ``divisor``, by :func:`shm_allreduce_direct` (two fences).

        A failed copy (a peer died) ends the job: the others may still be
        writing into this rank's memory.  ``who`` names this rank in that message.
        """
        xm, pids, _ = self._probed
        node, m, phase = self._nodes.node, len(x.arrays), self._rt.timeline.phase
        table = np.empty((len(pids), 2 * m), dtype=np.int64)
        with phase("direct address exchange (waiting for peers)"):
            node.Allgather(np.concatenate((x.addresses(), out.addresses())), table)   # every input is ready
        peers = [(pid, row[:m], row[m:]) for pid, row in zip(pids, table)]
        try:
            with phase("direct reduce (copies from and to the peers' memory)"):
                shm_allreduce_direct(x, out, op, self._nodes.local_rank, peers, xm, divisor=divisor)
        except OSError as exc:
            self._rt.abort(f"hpctrain: {who}: a direct copy between the ranks of this node failed during an "
                           f"all-reduce ({exc}); ending the job")
        with phase("direct barrier (waiting for peers)"):
            node.Barrier()      # every output is complete, and no peer reads this rank's input any more
