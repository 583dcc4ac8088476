"""The local backend: a world of one process that never imports MPI.

Every collective of one rank is a copy of its input (``avg`` of one value is
the value), so a script written for N ranks runs unchanged as ``python
script.py``.  Messages sent to oneself are queued and received in order.
"""
from __future__ import annotations

import collections
import copy
from typing import Any, List, Optional

import numpy as np

from ..life.abort import abort_job
from ..base import Communicator, Handle, Topology, done_handle
from .primitives import Primitives
from ..life.runtime import Config, Runtime
from ..call.signature import Call

__all__ = ["LocalBackend", "init_world"]


class LocalBackend(Primitives):
    """The primitives of a group of one rank."""

    kind = "local"

    def __init__(self, runtime: Runtime, name: str = "world"):
        super().__init__(runtime, 0, 1, name, (0,), Topology())
        self._mailbox: dict = collections.defaultdict(collections.deque)

    def exchange_calls(self, call: Call, carried=None) -> str:
        return ""

    def allreduce_native(self, acc: np.ndarray, op: str) -> np.ndarray:
        return acc

    def allgather_ints(self, value: int) -> List[int]:
        return [value]

    def alltoall_ints(self, values: List[int]) -> List[int]:
        return list(values)

    def allgatherv(self, raw: np.ndarray, counts: List[int]) -> np.ndarray:
        return raw.copy()

    def broadcast(self, raw: np.ndarray, root: int) -> None:
        pass

    def reduce_scatter_native(self, acc: np.ndarray, counts: List[int], op: str) -> np.ndarray:
        return acc

    def alltoallv(self, raw: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
        return raw.copy()

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return copy.deepcopy(obj)

    def allgather_object(self, obj: Any) -> List[Any]:
        return [copy.deepcopy(obj)]

    def isend(self, arr: np.ndarray, dest: int, tag: int) -> Handle:
        self._mailbox[tag].append(arr)
        return done_handle()

    def recv(self, source: int, tag: int) -> np.ndarray:
        if not self._mailbox[tag]:
            raise RuntimeError(f"recv(source=0, tag={tag}) in a world of one rank with no message sent: "
                               f"this would wait forever")
        return self._mailbox[tag].popleft()

    def isend_bytes(self, raw: np.ndarray, dest: int, tag: int) -> Handle:
        return self.isend(raw, dest, tag)

    def recv_bytes(self, source: int, tag: int) -> np.ndarray:
        return self.recv(source, tag)

    def iprobe(self, source: int, tag: int):
        tags = [t for t, box in self._mailbox.items() if box and tag in (-1, t)]
        return None if not tags else (0, tags[0], self._mailbox[tags[0]][0].nbytes)

    def split(self, color: Optional[int], key: int) -> Optional[Communicator]:
        return None if color is None else Communicator(LocalBackend(self._rt, f"{self.name}.split({color})"))


def init_world(config: Config) -> Communicator:
    """Return a world of one process."""
    return Communicator(LocalBackend(Runtime(config, 0, abort_job)))
