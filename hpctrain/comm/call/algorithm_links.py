"""What a registered algorithm may use of its communicator (see :mod:`hpctrain.collectives.registry`)."""
from __future__ import annotations

from typing import List

import numpy as np

__all__ = ["Links"]

# 8- and 16-bit integers go through the library in int32 and wrap back (as numpy does): Horovod's CPU
# ops do not reduce them at all, and Open MPI's AVX reductions (op/avx, wherever the CPU has AVX)
# saturate their sums instead of wrapping around (open-mpi/ompi#8045, closed as won't fix).  Every op
# gives numpy's result that way: int32 sums and products keep the low bits, min and max are exact.
_NARROW = frozenset(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16))


class Links:
    """What a registered algorithm's ``run`` may use of its communicator (see :mod:`hpctrain.collectives.registry`).

    The calls run inside the collective being performed: they are the
    backend's buffer primitives, not the checked public collectives.
    """

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.size = comm._rank, comm._size

    @property
    def transport(self):
        """Point-to-point messages: ``isend(buf, dest)``, ``irecv(buf, source)``, ``waitall(requests)``."""
        return self._comm._backend.transport()

    def native(self, acc: np.ndarray, op: str) -> np.ndarray:
        """Return the backend library's all-reduce of the flat buffer ``acc`` (it may reuse ``acc``)."""
        if acc.dtype in _NARROW:
            np.copyto(acc, self._comm._backend.allreduce_native(acc.astype(np.int32), op), casting="unsafe")
            return acc
        return self._comm._backend.allreduce_native(acc, op)

    def native_reduce_scatter(self, acc: np.ndarray, counts: List[int], op: str) -> np.ndarray:
        """Return this rank's block (``counts[rank]`` elements) of the library's reduction of flat ``acc``."""
        if acc.dtype in _NARROW:
            return self._comm._backend.reduce_scatter_native(acc.astype(np.int32), counts, op).astype(acc.dtype)
        return self._comm._backend.reduce_scatter_native(acc, counts, op)

    def broadcast(self, raw: np.ndarray, root: int) -> None:
        """Overwrite the flat uint8 array ``raw`` with root's, in place."""
        self._comm._backend.broadcast(raw, root)

    def phase(self, name: str, **args):
        """A context manager that puts the algorithm's phase ``name`` on the timeline (nothing while it is off)."""
        return self._comm._rt.timeline.phase(name, **args)

    def chunk_elems(self, itemsize: int) -> int:
        """Return the elements per message of a pipelined algorithm (``HPCTRAIN_RING_CHUNK_BYTES``)."""
        return self._comm._backend.chunk_elems(itemsize)
