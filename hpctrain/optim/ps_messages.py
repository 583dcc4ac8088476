"""The parameter server's protocol: who serves, the message tags, the shards, and a message (a clock and a few
arrays in one flat byte buffer, read back without pickle).

Layout: ``int64 clock, int64 count``, then per array ``int64 byte count``, its
dtype's string in 8 bytes and its bytes.  Cost: one copy to pack, none to
unpack (the arrays are views of the received buffer).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

__all__ = ["Roles", "pack", "unpack", "shard_bounds", "TAG_HELLO", "TAG_PUSH", "TAG_DONE", "TAG_REPLY", "TAG_FINAL"]

TAG_HELLO, TAG_PUSH, TAG_DONE, TAG_REPLY, TAG_FINAL = 7301, 7302, 7303, 7304, 7305


class Roles:
    """Who serves and who trains: the last ``servers`` ranks of ``size`` serve.

    Raises ValueError when fewer than ``servers + 1`` ranks are there.
    """

    def __init__(self, size: int, servers: int):
        if not isinstance(servers, int) or servers < 1:
            raise ValueError(f"servers must be an int >= 1, got {servers!r}")
        if size < servers + 1:
            raise ValueError(f"parameter-server training needs at least servers + 1 = {servers + 1} ranks "
                             f"(one to train), got {size}; launch more ranks or use fewer servers")
        self.servers = list(range(size - servers, size))
        self.workers = list(range(size - servers))

    def shard_of(self, rank: int) -> int:
        """The shard a server rank holds."""
        return self.servers.index(rank)


def shard_bounds(n: int, servers: int) -> List[Tuple[int, int]]:
    """``[lo, hi)`` of each server's shard of ``n`` values (sizes differ by at most one)."""
    cuts = [n * s // servers for s in range(servers + 1)]
    return [(cuts[s], cuts[s + 1]) for s in range(servers)]


def pack(clock: int, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """One message's bytes: ``clock``, then each array as (byte count, dtype, bytes); see :func:`unpack`."""
    head = [np.array([clock, len(arrays)], dtype=np.int64).view(np.uint8)]
    for a in arrays:
        a = np.ascontiguousarray(a)
        head.append(np.array([a.nbytes], dtype=np.int64).view(np.uint8))
        head.append(np.frombuffer(a.dtype.str.encode().ljust(8), dtype=np.uint8))
        head.append(a.reshape(-1).view(np.uint8))
    return np.concatenate(head)


def unpack(raw: np.ndarray) -> Tuple[int, List[np.ndarray]]:
    """``(clock, arrays)`` of a message made by :func:`pack` (the arrays are views of ``raw``)."""
    clock, count = (int(v) for v in raw[:16].view(np.int64))
    at, arrays = 16, []
    for _ in range(count):
        nbytes = int(raw[at:at + 8].view(np.int64)[0])
        dtype = np.dtype(raw[at + 8:at + 16].tobytes().decode().strip())
        arrays.append(raw[at + 16:at + 16 + nbytes].view(dtype))
        at += 16 + nbytes
    return clock, arrays
