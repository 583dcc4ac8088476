"""Where committed state's bytes go, apart from what is saved: a storage with named protocol steps.

As torch DCP keeps its planner apart from ``StorageWriter``/``StorageReader``,
the checkpoint manager decides what is saved (the plan, the snapshot, the
agreement of the ranks) and a :class:`Storage` puts the bytes somewhere, in
these steps:

1. ``prepare()`` (once, the committing rank): the place is usable; what a
   crash left half-written is removed.
2. ``begin(step)`` (the committing rank): an empty place for the parts of
   ``step``; an error if ``step`` is committed already.
3. ``write_part(step, part, meta)`` (every writer): one rank's part, with the
   checksums its commit records.
4. ``commit(step, world_size, receipts)`` (the committing rank): the manifest
   written last, so that a step exists only once all of it does.
5. ``abort(step)`` (the committing rank): nothing of ``step`` is left.
6. ``list()``: the committed steps, oldest first; ``prune(keep)`` removes all
   but the newest ``keep``.
7. ``read(step, ...)``: what a rank needs of committed ``step``, its bytes
   checked against the checksums its commit recorded.

:class:`FileStorage` is the checkpoint directory (``step-<N>/`` with tensor
files and ``manifest.json``; the format of :mod:`hpctrain.checkpoint.layout`,
read by :mod:`hpctrain.checkpoint.restore`).  :class:`MemoryStorage` keeps the
last commits in this process's memory, in the same encoding (elastic mode's
in-memory commits, :mod:`hpctrain.elastic.state`);
:class:`~hpctrain.checkpoint.peer_storage.PeerStorage` adds a copy on a peer.

Cost: the storage adds nothing to the bytes written; each step is the file
system calls (or dictionary operations) it names.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .layout import read_entries, read_spread, write_files, write_manifest
from .state import pack, packable, unpack
from .tensorfile import crc32

__all__ = ["Storage", "FileStorage", "MemoryStorage", "step_path", "committed_steps"]

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_path(directory: str, step: int) -> str:
    """The directory of the checkpoint of ``step`` under ``directory``."""
    return os.path.join(directory, f"step-{step:09d}")


def committed_steps(directory: str) -> List[int]:
    """The steps of the committed checkpoints under ``directory``, oldest first (not verified)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = []
    for name in names:
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(directory, name, "manifest.json")):
            steps.append(int(m.group(1)))
    return sorted(steps)


class Storage:
    """The named steps of a storage of committed state (module docstring)."""

    def prepare(self) -> None:
        """Make the storage usable and remove what a crash left half-written (the committing rank)."""

    def begin(self, step: int) -> None:
        """Make an empty place for the parts of ``step``; FileExistsError if ``step`` is committed already."""
        raise NotImplementedError

    def write_part(self, step: int, part: Any, meta: dict) -> Any:
        """Store one rank's ``part`` of ``step``; return the receipt its commit records."""
        raise NotImplementedError

    def commit(self, step: int, world_size: int, receipts: List[Any]) -> None:
        """Make ``step`` committed: from now on :meth:`list` has it (written last)."""
        raise NotImplementedError

    def abort(self, step: int) -> None:
        """Remove every part of ``step`` that was not committed."""
        raise NotImplementedError

    def list(self) -> List[int]:
        """The committed steps, oldest first."""
        raise NotImplementedError

    def read(self, step: int, *args) -> Any:
        """What a rank needs of committed ``step``, checked (CorruptFileError, a ValueError, when it does not
        match its checksums)."""
        raise NotImplementedError

    def prune(self, keep: int) -> None:
        """Remove every committed step but the newest ``keep``."""
        for old in self.list()[:-keep]:
            self.remove(old)

    def remove(self, step: int) -> None:
        """Remove committed ``step``."""
        raise NotImplementedError

    def save(self, step: int, part: Any, meta: Any = None) -> None:
        """``begin``, ``write_part`` and ``commit`` of a step of one part at once (a process's own commit); what
        was written is aborted when a step fails."""
        self.begin(step)
        try:
            receipt = self.write_part(step, part, meta)
        except BaseException:
            self.abort(step)
            raise
        self.commit(step, 1, [receipt])


class FileStorage(Storage):
    """The checkpoint directory ``directory``: ``step-<N>.partial/`` while written, ``step-<N>/`` with its
    ``manifest.json`` once committed (the format of :mod:`hpctrain.checkpoint.layout`)."""

    PARTIAL = ".partial"

    def __init__(self, directory: str):
        self.directory = os.path.abspath(directory)

    def location(self, step: int) -> str:
        """The directory of committed ``step``."""
        return step_path(self.directory, step)

    def partial(self, step: int) -> str:
        """The directory ``step`` is written into before its commit."""
        return self.location(step) + self.PARTIAL

    def prepare(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        for name in os.listdir(self.directory):     # left by a crash in the middle of a save
            if name.startswith("step-") and name.endswith(self.PARTIAL):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def begin(self, step: int) -> None:
        shutil.rmtree(self.partial(step), ignore_errors=True)
        if os.path.exists(self.location(step)):
            raise FileExistsError(f"{self.location(step)} exists already")
        os.makedirs(self.partial(step))

    def write_part(self, step: int, part: Any, meta: dict) -> dict:
        """``part``: the writer's jobs, ``(file name, tensors, tree, is_replica)`` (:func:`layout.write_files`)."""
        return write_files(self.partial(step), part, meta)

    def commit(self, step: int, world_size: int, receipts: List[dict]) -> None:
        write_manifest(self.partial(step), self.location(step), step, world_size, receipts)

    def abort(self, step: int) -> None:
        shutil.rmtree(self.partial(step), ignore_errors=True)

    def list(self) -> List[int]:
        return committed_steps(self.directory)

    def read(self, step: int, state: Dict[str, Any], rank: int) -> Dict[str, Any]:
        """What ``rank`` needs of ``state``'s entries from committed ``step``: ``{key: (kind, value)}``
        (:func:`~hpctrain.checkpoint.layout.read_entries`: every file checked against the manifest)."""
        return read_entries(self.location(step), step, state, rank)

    def read_spread(self, step: int, key: str, rank: int) -> Any:
        """Rank ``rank``'s part of spread entry ``key`` of committed ``step``, checked."""
        return read_spread(self.location(step), key, rank)

    def remove(self, step: int) -> None:
        shutil.rmtree(self.location(step), ignore_errors=True)


class MemoryStorage(Storage):
    """The last ``kept`` commits in this process's memory, each part in the checkpoint's encoding.

    ``write_part(step, part)``: ``part`` is a ``{name: value}`` tree of live
    values; it is packed at once (:func:`~hpctrain.checkpoint.state.pack`: one
    safetensors buffer) and its CRC-32 computed on a helper thread while the
    caller goes on.  A value the encoding refuses (an object of the
    program's own, not data) is held as its deep copy.  :meth:`read` checks
    the CRC-32 and gives values in memory of their own.  The buffer of the
    step removed last is written into by the next (fresh memory's page faults
    cost as much as the copy).  Cost of a commit: one copy of the part (and
    one CRC-32 pass beside the caller); memory: ``kept`` encodings and that
    spare one (a deep copy's peak, held).
    """

    def __init__(self, kept: int):
        self.kept = kept
        self._parts: "OrderedDict[int, Any]" = OrderedDict()    # step -> ((bytes, CRC-32 or its Future), held)
        self._open: Dict[int, Any] = {}
        self._spare: Optional[Tuple[np.ndarray, Any]] = None     # the step removed last: its buffer, CRC-32
        self._hasher: Optional[ThreadPoolExecutor] = None

    def begin(self, step: int) -> None:
        if step in self._parts:
            raise FileExistsError(f"commit {step} exists already")
        self._open[step] = None

    def write_part(self, step: int, part: Dict[str, Any], meta: Optional[dict] = None) -> None:
        """Pack ``part`` (values that are not data: deep copies) and start its CRC-32 on the helper thread."""
        data, held, spare = dict(part), {}, self.take_spare()
        try:
            raw, _ = pack(data, into=spare, checksum=False, allocate=self._allocate)
        except TypeError:                   # (raised by the tree walk, before any copy: find the values that are
            for name in list(data):         # not data, one by one, without copying them)
                if not packable(data[name]):
                    held[name] = copy.deepcopy(data.pop(name))
            raw, _ = pack(data, into=spare, checksum=False, allocate=self._allocate)
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-commit-crc")
        self._open[step] = ((raw, self._hasher.submit(self._seal, step, raw, held)), held)

    def _seal(self, step: int, raw: np.ndarray, held: Dict[str, Any]) -> int:
        """On the helper thread: the CRC-32 of ``step``'s bytes (a subclass also keeps them elsewhere)."""
        return crc32(raw)

    def _allocate(self, size: int) -> np.ndarray:
        """A buffer of ``size`` bytes for a step's bytes when the spare one is too small (fresh memory here)."""
        return np.empty(size, dtype=np.uint8)

    def in_memory(self) -> "MemoryStorage":
        """A :class:`MemoryStorage` holding this storage's committed steps (the same buffers), without whatever
        else a subclass does with them."""
        plain = MemoryStorage(self.kept)
        plain._parts.update(self._parts)
        return plain

    def take_spare(self) -> Optional[np.ndarray]:
        """The buffer of the step removed last (None if none), for a new step's bytes."""
        if self._spare is None:
            return None
        (spare, crc), self._spare = self._spare, None
        _value(crc)         # (its CRC-32 may still be reading it)
        return spare

    def commit(self, step: int, world_size: int = 1, receipts: Optional[List[Any]] = None) -> None:
        self._parts[step] = self._open.pop(step)
        self.prune(self.kept)

    def abort(self, step: int) -> None:
        self._open.pop(step, None)

    def list(self) -> List[int]:
        return list(self._parts)

    def read(self, step: int) -> Dict[str, Any]:
        """The part committed as ``step``, checked against its CRC-32 (CorruptFileError, a ValueError, if its
        bytes changed); KeyError if it is not kept."""
        (raw, crc), held = self._parts[step]
        out = unpack(raw, _value(crc))
        out.update(copy.deepcopy(held))
        return out

    def held(self, step: int) -> Dict[str, Any]:
        """The values of ``step`` held as objects (not data), without decoding the rest."""
        return dict(self._parts[step][1])

    def remove(self, step: int) -> None:
        gone = self._parts.pop(step, None)
        if gone is not None:
            raw, crc = gone[0]
            self._spare = (raw.base if isinstance(raw.base, np.ndarray) else raw, crc)


def _value(crc: Any) -> int:
    """A CRC-32, waited for when it is still being computed (a Future)."""
    return crc.result() if isinstance(crc, Future) else crc
