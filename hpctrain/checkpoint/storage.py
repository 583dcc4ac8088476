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

:class:`FileStorage` is the checkpoint directory (``step-<N>/`` with tensor
files and ``manifest.json``; the format of :mod:`hpctrain.checkpoint.layout`,
read by :mod:`hpctrain.checkpoint.restore`).  :class:`MemoryStorage` keeps the
last commits in this process's memory (elastic mode's in-memory commits,
:mod:`hpctrain.elastic.state`).

Cost: the storage adds nothing to the bytes written; each step is the file
system calls (or dictionary operations) it names.
"""
from __future__ import annotations

import os
import re
import shutil
from collections import OrderedDict
from typing import Any, Dict, List, Optional

from .layout import write_files, write_manifest

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

    def remove(self, step: int) -> None:
        shutil.rmtree(self.location(step), ignore_errors=True)


class MemoryStorage(Storage):
    """The last ``kept`` commits in this process's memory: each step's one part, as given (no copy)."""

    def __init__(self, kept: int):
        self.kept = kept
        self._parts: "OrderedDict[int, Any]" = OrderedDict()
        self._open: Dict[int, Any] = {}

    def begin(self, step: int) -> None:
        if step in self._parts:
            raise FileExistsError(f"commit {step} exists already")
        self._open[step] = None

    def write_part(self, step: int, part: Any, meta: Optional[dict] = None) -> None:
        self._open[step] = part

    def commit(self, step: int, world_size: int = 1, receipts: Optional[List[Any]] = None) -> None:
        self._parts[step] = self._open.pop(step)
        self.prune(self.kept)

    def abort(self, step: int) -> None:
        self._open.pop(step, None)

    def list(self) -> List[int]:
        return list(self._parts)

    def read(self, step: int) -> Any:
        """The part committed as ``step``; KeyError if it is not kept."""
        return self._parts[step]

    def remove(self, step: int) -> None:
        self._parts.pop(step, None)

