"""What a backend provides: the buffer primitives under every collective (numpy buffers only).

A backend (MPI, Horovod, local) is a :class:`Primitives` subclass that
implements the abstract methods here; the others have defaults for backends
without shared memory or header-less messages.  The
:class:`~hpctrain.comm.base.Communicator` facade holds one and calls these;
features never do.  Optional capabilities a backend may have are attributes
here, None where it has not: ``named_allreduce_async`` and ``gather_bytes``
(Horovod's named operations, for hpctrain.horovod's negotiation), ``mpi_comm``
(the MPI communicator a re-forming shrinks).
"""
from __future__ import annotations

import abc
from typing import Any, Callable, List, Optional, Sequence

import numpy as np

from ...collectives.flat import Flat
from ..call.handle import Handle, CarriedByCheck, Topology
from ..call.signature import Call

__all__ = ["Primitives"]


class Primitives(abc.ABC):
    """The buffer primitives of one group of ranks over one library (see the module docstring).

    Args:
        runtime: the world's runtime (settings, lanes, watchdog).
        rank: this process's rank in the group.
        size: the number of ranks in the group.
        name: a label for messages ("world", "world.split(1)").
        world_ranks: the world rank of each member, in group order.
        topology: node layout of this process.
    """

    kind = "abstract"                   # the backend's name: "mpi", "horovod", "local"
    named_allreduce_async = None        # capabilities (see the module docstring): None where the backend has none
    gather_bytes = None
    mpi_comm = None

    def __init__(self, runtime, rank: int, size: int, name: str, world_ranks: Sequence[int], topology: Topology):
        self._rt, self._rank, self._size = runtime, rank, size
        self.name, self.world_ranks, self.topology = name, tuple(world_ranks), topology

    @property
    def runtime(self):
        """The world's :class:`~hpctrain.comm.life.runtime.Runtime`."""
        return self._rt

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def chunk_elems(self, itemsize: int) -> int:
        """Return the elements per message of pipelined algorithms (``HPCTRAIN_RING_CHUNK_BYTES``)."""
        return max(1, self._rt.config.ring_chunk_bytes // max(1, itemsize))

    def no_shared_memory(self) -> str:
        """Return why the ranks of a node cannot share memory windows here ("" if they can)."""
        return f"the {self.kind} backend has no shared-memory windows"

    def allreduce_shared(self, x: Flat, out: Flat, op: str, alg: str, divisor: int = 1) -> None:
        """All-reduce ``x`` into ``out`` (accumulation dtype) with "shm" or "hierarchical", divided by ``divisor``."""
        raise ValueError(f"the {self.kind} backend has no shared-memory algorithms")

    def reduce_scatter_shared(self, x: np.ndarray, bounds, acc_dtype, op: str) -> np.ndarray:
        """Return this rank's segment of the shared-memory reduction of flat ``x``."""
        raise ValueError(f"the {self.kind} backend has no shared-memory algorithms")

    def allgather_shared(self, raw: np.ndarray, counts: List[int]) -> Optional[np.ndarray]:
        """Return the shared-memory all-gather of bytes, or None where it does not apply (several nodes)."""
        return None

    def shared_empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def shared_buffer_of(self, arr: np.ndarray):
        """The shared buffer that ``arr`` is (from :meth:`shared_empty`), or None."""
        return None

    def reduce_shared_buffer(self, buf, op: str, divisor: int = 1) -> None:
        raise NotImplementedError

    def release_shared(self) -> None:
        """Free shared-memory resources (collective over the node)."""

    def allreduce_with_check(self, arr: np.ndarray, op: str, alg: str, inplace: bool) -> Optional[CarriedByCheck]:
        """Return the all-reduce of ``arr`` as work carried along with the call check, or None where it cannot."""
        return None

    def reduce_scatter_with_check(self, arr: np.ndarray, bounds, op: str) -> Optional[CarriedByCheck]:
        """Return the reduce-scatter of ``arr`` (rank i's block: flat elements ``bounds[i]:bounds[i+1]``) as
        work carried by the call check, giving this rank's flat block; or None where it cannot."""
        return None

    def gather_with_check(self, raw: np.ndarray, post: bool, then: Callable[[List[int], Optional[List[np.ndarray]]], Any]
                       ) -> Optional[CarriedByCheck]:
        """Return work carried by the call check that announces every rank's byte count of ``raw`` and, where
        ``post`` and every rank's fits, carries the bytes too; it returns ``then(sizes, parts)`` (``parts``:
        every rank's bytes, or None when they did not travel).  None where the backend cannot."""
        return None

    def repeat_reduce_scatter(self, call: Call, arr: np.ndarray, bounds, op: str, alg: str):
        """Return ``body(a, seq)``: one exchange that checks ``call`` and returns this rank's flat block of the
        reduce-scatter of ``a`` (like ``arr``); or None where the backend has none (see :mod:`hpctrain.comm.call.repeated_calls`)."""
        return None

    def repeat_gather(self, call: Call, post: bool, then):
        """Return ``body(a, seq)``: one exchange that checks ``call`` and announces every rank's byte count of
        ``a`` (with the bytes where ``post`` and all fit), returning ``then(a, sizes, parts)``; or None."""
        return None

    def repeat_exchange(self, call: Call, arr: np.ndarray, op: str, alg: str
                       ) -> Optional[Callable[[np.ndarray, np.ndarray, int], None]]:
        """Return ``exchange(x, out, seq)``: one exchange that checks ``call`` on every rank and leaves the
        all-reduce of ``x`` (like ``arr``) in ``out``, raising CollectiveMismatchError when the calls differ; or
        None where the backend has none (then repeated calls are planned each time; see :mod:`hpctrain.comm.call.repeated_calls`).
        """
        return None

    @abc.abstractmethod
    def exchange_calls(self, call: Call, carried: Optional[CarriedByCheck] = None) -> str:
        """Compare ``call`` across ranks; return "" if all agree, else the message for every rank.

        ``carried`` (from the ``*_with_check`` methods) carries a payload to post with the call.
        """

    @abc.abstractmethod
    def allreduce_native(self, acc: np.ndarray, op: str) -> np.ndarray:
        """Return the library's all-reduce of the flat buffer ``acc`` (may reuse ``acc``)."""

    def transport(self):
        """Return the point-to-point transport the ring algorithms use."""
        raise ValueError(f"the {self.kind} backend has no point-to-point messages for algorithm='ring'")

    @abc.abstractmethod
    def allgather_ints(self, value: int) -> List[int]:
        """Return every rank's ``value``."""

    @abc.abstractmethod
    def alltoall_ints(self, values: List[int]) -> List[int]:
        """Send ``values[i]`` to rank i; return what each rank sent here."""

    @abc.abstractmethod
    def allgatherv(self, raw: np.ndarray, counts: List[int]) -> np.ndarray:
        """Return the concatenation of every rank's bytes ``raw`` (rank i has ``counts[i]`` bytes)."""

    @abc.abstractmethod
    def broadcast(self, raw: np.ndarray, root: int) -> None:
        """Overwrite ``raw`` (bytes) with root's in place."""

    @abc.abstractmethod
    def reduce_scatter_native(self, acc: np.ndarray, counts: List[int], op: str) -> np.ndarray:
        """Return this rank's block (``counts[rank]`` elements) of the reduction of flat ``acc``."""

    @abc.abstractmethod
    def alltoallv(self, raw: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
        """Exchange byte blocks: ``send[i]`` bytes to rank i; return the ``recv`` blocks concatenated."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Synchronize the ranks."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int) -> Any:
        """Return root's object."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> List[Any]:
        """Return every rank's object."""

    @abc.abstractmethod
    def isend(self, arr: np.ndarray, dest: int, tag: int) -> Handle:
        """Start sending ``arr`` (owned by the call) with its dtype and shape; return a handle."""

    @abc.abstractmethod
    def recv(self, source: int, tag: int) -> np.ndarray:
        """Receive an array sent by :meth:`isend`."""

    def isend_bytes(self, raw: np.ndarray, dest: int, tag: int) -> Handle:
        """Start sending the flat uint8 array ``raw`` (owned by the call) alone; return a handle."""
        raise NotImplementedError(f"the {self.kind} backend has no header-less point-to-point messages")

    def recv_bytes(self, source: int, tag: int) -> np.ndarray:
        """Receive a message sent by :meth:`isend_bytes`, as a flat uint8 array of its length."""
        raise NotImplementedError(f"the {self.kind} backend has no header-less point-to-point messages")

    @abc.abstractmethod
    def iprobe(self, source: int, tag: int):
        """``(source, tag, bytes)`` of a message that has arrived and matches (-1: any), or None; local."""
        raise NotImplementedError(f"the {self.kind} backend has no point-to-point messages")

    def recv_found(self, source: int, tag: int) -> np.ndarray:
        """Take the message a probe found (a backend whose receives can fail for ranks that failed overrides it)."""
        return self.recv_bytes(source, tag)

    @abc.abstractmethod
    def split(self, color: Optional[int], key: int) -> Optional[Any]:
        """Return the sub-communicator (a :class:`~hpctrain.comm.base.Communicator` over a backend of the same
        kind) for ``color`` (None for color None)."""

    def free(self) -> None:
        """Release backend resources."""
