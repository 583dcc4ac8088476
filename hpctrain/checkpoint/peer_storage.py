"""Committed state that differs per rank, kept also on a peer of another node, and brought back after a failure.

A state spread over the ranks (a :class:`~hpctrain.torch.ShardedOptimizer`:
each rank holds its own chunks) is committed without gathering it: each rank
keeps its part (:func:`pack`: the checkpoint's encoding, a safetensors byte
string from :func:`~hpctrain.checkpoint.tensorfile.encode_tensors` with its
CRC-32 and the tree in its metadata, no pickle) and sends a copy to its *buddy*, the next rank (cyclically) on
another node, or the next rank on a one-node world (:func:`buddies`,
:func:`exchange`: one all-to-all).  After a failure :func:`recover` gives
every survivor every old rank's part: the rank's own copy where it
survived, else its buddy's; a part whose copy fails its checksum counts as
lost.  When both copies of a part are gone every rank raises the same
:class:`PartLost`, naming the ranks.  :class:`PeerStorage` is the storage
(:mod:`hpctrain.checkpoint.storage`) of these parts: one value's part of
each of the last commits, over the world it was committed in.

Cost of a commit: one copy of this rank's part and one all-to-all of its
bytes (``1/N`` of the spread state per rank).  Memory: two parts per rank
(its own and its wards').  Recovery: one allgather of the old ranks' parts
(the whole spread state passes through every survivor once).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import HpctrainError
from .state import pack, unpack
from .tensorfile import CorruptFileError
from .storage import MemoryStorage

__all__ = ["PartLost", "PeerStorage", "pack", "unpack", "buddies", "exchange", "recover"]

class PartLost(HpctrainError):
    """A rank's part of a committed state and its copy on the buddy rank both died with their ranks."""


def buddies(nodes: Sequence[int]) -> List[int]:
    """Each rank's buddy: the next rank (cyclically) whose node differs, or the next rank when all share one."""
    n = len(nodes)
    out = []
    for r in range(n):
        others = [(r + k) % n for k in range(1, n) if nodes[(r + k) % n] != nodes[r]]
        out.append(others[0] if others else (r + 1) % n)
    return out


def exchange(comm, raw: np.ndarray, crc: int) -> Dict[int, Tuple[np.ndarray, int]]:
    """Send this rank's part to its buddy; return the parts its wards sent, ``{rank: (bytes, crc)}``.

    Collective (one small allgather of the nodes and sizes, one all-to-all).
    """
    if comm.size == 1:
        return {}
    nodes_sizes = comm.allgather_object((comm.topology.node_rank, int(raw.size), int(crc)))
    buddy = buddies([node for node, _, _ in nodes_sizes])
    splits = [raw.size if r == buddy[comm.rank] else 0 for r in range(comm.size)]
    got = comm.alltoall(raw, splits=splits)
    out, pos = {}, 0
    for r, (_, size, crc_r) in enumerate(nodes_sizes):
        if buddy[r] == comm.rank:
            out[r] = (got[pos:pos + size].copy(), crc_r)
            pos += size
    return out


def recover(comm, old_rank: int, own: Tuple[np.ndarray, int], wards: Dict[int, Tuple[np.ndarray, int]],
            old_size: int) -> Dict[int, Dict[str, Any]]:
    """Every old rank's part, on every rank of the re-formed ``comm``: ``{old rank: part}``.

    Each survivor offers its own part and those of its wards whose rank did
    not survive (a part offered twice is taken once, its owner's first).
    Collective.  Raises :class:`PartLost` on every rank when some old rank's
    part has no intact copy left.
    """
    offers = comm.allgather_object((old_rank, sorted(wards)))
    alive = {r for r, _ in offers}
    mine = {old_rank: own}
    mine.update({r: part for r, part in wards.items() if r not in alive})
    gathered = comm.allgather_object({r: (raw.tobytes(), crc) for r, (raw, crc) in mine.items()})
    parts: Dict[int, Dict[str, Any]] = {}
    for offer in gathered:
        for r, (raw, crc) in offer.items():
            if r in parts:
                continue
            try:
                parts[r] = unpack(np.frombuffer(raw, dtype=np.uint8), crc)
            except CorruptFileError:
                continue
    lost = [r for r in range(old_size) if r not in parts]
    if lost:
        raise PartLost(f"hpctrain: the committed part of old rank(s) {lost} and its copy on the buddy rank are both "
                       f"lost (or fail their checksum); the in-memory commit cannot be rebuilt: restart from the "
                       f"newest disk checkpoint (CheckpointManager)")
    return parts



class PeerStorage(MemoryStorage):
    """One value's part of each of the last ``kept`` commits: this rank's own and its wards' copies, over ``comm``.

    ``write_part(step, tree)`` packs this rank's part and exchanges it with
    the buddies (collective over ``comm``); ``commit(step)`` keeps it (the
    oldest beyond ``kept`` go); ``save`` is the three at once.
    :meth:`read` gives this rank's own part back (checked); :meth:`recover`
    every old rank's part on a re-formed world.
    """

    def __init__(self, comm, kept: int, node: Optional[Tuple[Any, Callable, str]] = None):
        super().__init__(kept)
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.node = node        # (NodeFolder, where(), value name): also write each commit's parts there
        self._writes: Dict[int, Tuple[Future, List[str], Any]] = {}

    def commit(self, step: int, world_size: int = 1, receipts: Optional[List[Any]] = None) -> None:
        """Keep ``step``'s parts; with a node folder also write them there, on the helper thread: this rank's own
        (``...-r<rank>of<size>-s<name>``) and its wards' (``...-r<ward>of<size>-s<name>-by<rank>``)."""
        super().commit(step, world_size, receipts)
        if self.node is None or step not in self._parts:
            return
        folder, where, name = self.node
        g, e, rank, size = where()
        own, wards = self._parts[step]
        jobs = [(f"g{g}-e{e}-c{step}-r{rank}of{size}-s{name}", own)]
        jobs += [(f"g{g}-e{e}-c{step}-r{r}of{size}-s{name}-by{rank}", part) for r, part in sorted(wards.items())]
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-commit-crc")
        self._writes[step] = (self._hasher.submit(lambda: [folder.write(stem, raw, crc, {})
                                                           for stem, (raw, crc) in jobs]),
                              [stem for stem, _ in jobs], folder)

    def remove(self, step: int) -> None:
        write, stems, folder = self._writes.pop(step, (None, [], None))
        if write is not None:
            write.result()          # (it reads the buffers the next step may reuse)
            for stem in stems:
                folder.delete(stem)
        super().remove(step)

    def wait(self) -> None:
        """Wait until every commit's node-local writes have finished."""
        for write, _, _ in self._writes.values():
            write.result()

    def write_part(self, step: int, part: Dict[str, Any], meta: Any = None) -> int:
        """Pack ``part``, keep it and send its copy to the buddy (collective); return its CRC-32."""
        raw, crc = pack(part, into=self.take_spare())
        self._open[step] = ((raw, crc), exchange(self.comm, raw, crc))
        return crc

    def read(self, step: int) -> Dict[str, Any]:
        """This rank's own part of ``step``, checked against its CRC-32."""
        return unpack(*self._parts[step][0])

    def recover(self, step: int, comm) -> Dict[int, Dict[str, Any]]:
        """Every old rank's part of ``step`` on every rank of the re-formed ``comm`` (:func:`recover`)."""
        own, wards = self._parts[step]
        return recover(comm, self.rank, own, wards, self.size)
