"""What a backend provides: the buffer primitives under every collective (numpy buffers only).

A backend (MPI, Horovod, local) subclasses :class:`~hpctrain.comm.base.Communicator`
and implements the abstract methods here; the others have defaults for
backends without shared memory or header-less messages.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import numpy as np

from ...collectives.flat import Flat
from ..call.handle import Handle, CarriedByCheck
from ..call.signature import Call

if TYPE_CHECKING:
    from ..base import Communicator

__all__ = ["Primitives"]


class Primitives(abc.ABC):
    """The buffer primitives a backend implements (see the module docstring)."""

    backend = "abstract"

    def _chunk_elems(self, itemsize: int) -> int:
        """Return the elements per message of pipelined algorithms (``HPCTRAIN_RING_CHUNK_BYTES``)."""
        return max(1, self._rt.config.ring_chunk_bytes // max(1, itemsize))

    def _no_shared_memory(self) -> str:
        """Return why the ranks of a node cannot share memory windows here ("" if they can)."""
        return f"the {self.backend} backend has no shared-memory windows"

    def _allreduce_shared(self, x: Flat, out: Flat, op: str, alg: str, divisor: int = 1) -> None:
        """All-reduce ``x`` into ``out`` (accumulation dtype) with "shm" or "hierarchical", divided by ``divisor``."""
        raise ValueError(f"the {self.backend} backend has no shared-memory algorithms")

    def _reduce_scatter_shared(self, x: np.ndarray, bounds, acc_dtype, op: str) -> np.ndarray:
        """Return this rank's segment of the shared-memory reduction of flat ``x``."""
        raise ValueError(f"the {self.backend} backend has no shared-memory algorithms")

    def _allgather_shared(self, raw: np.ndarray, counts: List[int]) -> Optional[np.ndarray]:
        """Return the shared-memory all-gather of bytes, or None where it does not apply (several nodes)."""
        return None

    def _shared_empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def _shared_buffer_of(self, arr: np.ndarray):
        """The shared buffer that ``arr`` is (from :meth:`shared_empty`), or None."""
        return None

    def _reduce_shared_buffer(self, buf, op: str, divisor: int = 1) -> None:
        raise NotImplementedError

    def _release_shared(self) -> None:
        """Free shared-memory resources (collective over the node)."""

    def _allreduce_with_check(self, arr: np.ndarray, op: str, alg: str, inplace: bool) -> Optional[CarriedByCheck]:
        """Return the all-reduce of ``arr`` as work carried along with the call check, or None where it cannot."""
        return None

    def _reduce_scatter_with_check(self, arr: np.ndarray, bounds, op: str) -> Optional[CarriedByCheck]:
        """Return the reduce-scatter of ``arr`` (rank i's block: flat elements ``bounds[i]:bounds[i+1]``) as
        work carried by the call check, giving this rank's flat block; or None where it cannot."""
        return None

    def _gather_with_check(self, raw: np.ndarray, post: bool, then: Callable[[List[int], Optional[List[np.ndarray]]], Any]
                       ) -> Optional[CarriedByCheck]:
        """Return work carried by the call check that announces every rank's byte count of ``raw`` and, where
        ``post`` and every rank's fits, carries the bytes too; it returns ``then(sizes, parts)`` (``parts``:
        every rank's bytes, or None when they did not travel).  None where the backend cannot."""
        return None

    def _repeat_reduce_scatter(self, call: Call, arr: np.ndarray, bounds, op: str, alg: str):
        """Return ``body(a, seq)``: one exchange that checks ``call`` and returns this rank's flat block of the
        reduce-scatter of ``a`` (like ``arr``); or None where the backend has none (see :mod:`hpctrain.comm.call.repeated_calls`)."""
        return None

    def _repeat_gather(self, call: Call, post: bool, then):
        """Return ``body(a, seq)``: one exchange that checks ``call`` and announces every rank's byte count of
        ``a`` (with the bytes where ``post`` and all fit), returning ``then(a, sizes, parts)``; or None."""
        return None

    def _repeat_exchange(self, call: Call, arr: np.ndarray, op: str, alg: str
                       ) -> Optional[Callable[[np.ndarray, np.ndarray, int], None]]:
        """Return ``exchange(x, out, seq)``: one exchange that checks ``call`` on every rank and leaves the
        all-reduce of ``x`` (like ``arr``) in ``out``, raising CollectiveMismatchError when the calls differ; or
        None where the backend has none (then repeated calls are planned each time; see :mod:`hpctrain.comm.call.repeated_calls`).
        """
        return None

    @abc.abstractmethod
    def _exchange_calls(self, call: Call, carried: Optional[CarriedByCheck] = None) -> str:
        """Compare ``call`` across ranks; return "" if all agree, else the message for every rank.

        ``carried`` (from the ``_*_with_check`` methods) carries a payload to post with the call.
        """

    @abc.abstractmethod
    def _allreduce_native(self, acc: np.ndarray, op: str) -> np.ndarray:
        """Return the library's all-reduce of the flat buffer ``acc`` (may reuse ``acc``)."""

    def _transport(self):
        """Return the point-to-point transport the ring algorithms use."""
        raise ValueError(f"the {self.backend} backend has no point-to-point messages for algorithm='ring'")

    @abc.abstractmethod
    def _allgather_ints(self, value: int) -> List[int]:
        """Return every rank's ``value``."""

    @abc.abstractmethod
    def _alltoall_ints(self, values: List[int]) -> List[int]:
        """Send ``values[i]`` to rank i; return what each rank sent here."""

    @abc.abstractmethod
    def _allgatherv(self, raw: np.ndarray, counts: List[int]) -> np.ndarray:
        """Return the concatenation of every rank's bytes ``raw`` (rank i has ``counts[i]`` bytes)."""

    @abc.abstractmethod
    def _broadcast(self, raw: np.ndarray, root: int) -> None:
        """Overwrite ``raw`` (bytes) with root's in place."""

    @abc.abstractmethod
    def _reduce_scatter_native(self, acc: np.ndarray, counts: List[int], op: str) -> np.ndarray:
        """Return this rank's block (``counts[rank]`` elements) of the reduction of flat ``acc``."""

    @abc.abstractmethod
    def _alltoallv(self, raw: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
        """Exchange byte blocks: ``send[i]`` bytes to rank i; return the ``recv`` blocks concatenated."""

    @abc.abstractmethod
    def _barrier(self) -> None:
        """Synchronize the ranks."""

    @abc.abstractmethod
    def _broadcast_object(self, obj: Any, root: int) -> Any:
        """Return root's object."""

    @abc.abstractmethod
    def _allgather_object(self, obj: Any) -> List[Any]:
        """Return every rank's object."""

    @abc.abstractmethod
    def _isend(self, arr: np.ndarray, dest: int, tag: int) -> Handle:
        """Start sending ``arr`` (owned by the call) with its dtype and shape; return a handle."""

    @abc.abstractmethod
    def _recv(self, source: int, tag: int) -> np.ndarray:
        """Receive an array sent by :meth:`_send`."""

    def _isend_bytes(self, raw: np.ndarray, dest: int, tag: int) -> Handle:
        """Start sending the flat uint8 array ``raw`` (owned by the call) alone; return a handle."""
        raise NotImplementedError(f"the {self.backend} backend has no header-less point-to-point messages")

    def _recv_bytes(self, source: int, tag: int) -> np.ndarray:
        """Receive a message sent by :meth:`_isend_bytes`, as a flat uint8 array of its length."""
        raise NotImplementedError(f"the {self.backend} backend has no header-less point-to-point messages")

    @abc.abstractmethod
    def _split(self, color: Optional[int], key: int) -> Optional["Communicator"]:
        """Return the sub-communicator for ``color`` (None for color None)."""

    def _free(self) -> None:
        """Release backend resources."""
