"""Commit an asynchronous save as soon as every rank has written it, without waiting for the next ``save()``.

Each rank's writer thread, once its files are written and fsynced, leaves a
marker ``.written-rank<R>.json`` in the partial directory: its result (file
sizes and CRC-32s, the checksums of the replicated entries) or its error.
Rank 0 runs a :class:`BackgroundCommit` per save: after its own write it
looks for the markers of the ranks whose results the manifest needs (every
rank when replicas are verified, else the writers), at pauses doubling from
2 ms to 200 ms, and once all are there it commits exactly as the collective
commit would (:func:`finish`), from the markers' results.  The collective
commit at the next ``save()``/``wait()`` stays the authority: it gathers the
same results from every rank and :meth:`BackgroundCommit.claim` tells it
whether rank 0 already committed (or failed), else it commits itself.  So a
marker that never appears (a file system that does not show it to rank 0, a
rank that cannot write it) delays the commit to that point, as before, and
never blocks it.

Cost: one small file per rank and save, and rank 0's polls of them (one
``stat`` per awaited rank per pause).  On a shared file system that caches
attributes (NFS) rank 0 sees a marker up to that cache's time late.
"""
from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, Iterable, List, Optional, Tuple

__all__ = ["post_written", "remove_markers", "BackgroundCommit", "Outcome"]

_FIRST_PAUSE_S, _LAST_PAUSE_S = 0.002, 0.2

Outcome = Tuple[str, Optional[str]]      # ("committed" | "failed" | "claimed", error)


def _marker(partial: str, rank: int) -> str:
    return os.path.join(partial, f".written-rank{rank}.json")


def post_written(partial: str, rank: int, result: Optional[dict], error: Optional[str]) -> None:
    """Leave this rank's marker (its result or error) in ``partial``; a failure to do so is left to the collective
    commit (the marker only lets rank 0 commit earlier)."""
    path = _marker(partial, rank)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "result": result, "error": error}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def remove_markers(partial: str, ranks: Iterable[int]) -> None:
    """Remove the markers of ``ranks`` (before the directory is renamed into a checkpoint)."""
    for r in ranks:
        for path in (_marker(partial, r), _marker(partial, r) + ".tmp"):
            try:
                os.remove(path)
            except OSError:
                pass


def _read(partial: str, rank: int) -> Optional[dict]:
    try:
        with open(_marker(partial, rank)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None        # not there yet (or caught mid-rename on a file system without atomic replace)


class BackgroundCommit:
    """Rank 0's commit of one save once the markers of ``awaited`` ranks are all in ``partial``.

    Args:
        partial: the save's partial directory.
        own: rank 0's write (a Future of its result).
        awaited: the other ranks whose results the commit needs.
        size: the world size (results of ranks not awaited count as empty).
        empty: the result of a rank that wrote nothing and verified nothing.
        finish: ``finish(results, errors) -> error or None``: the commit itself (the manager's, shared with the
            collective commit), called with the lock held.
    """

    def __init__(self, partial: str, own: Future, awaited: List[int], size: int, empty: dict,
                 finish: Callable[[List[dict], List[Optional[str]]], Optional[str]]):
        self.partial, self._own, self._awaited, self._size, self._empty = partial, own, awaited, size, empty
        self._finish = finish
        self._lock = threading.Lock()
        self._outcome: Optional[Outcome] = None
        self._thread = threading.Thread(target=self._run, name="hpctrain-checkpoint-commit", daemon=True)
        self._thread.start()

    def claim(self) -> Outcome:
        """Return what the background commit did (``committed``/``failed``), or stop it and return ``claimed``.

        Called by the collective commit; waits while a commit is being written.
        """
        with self._lock:
            if self._outcome is None:
                self._outcome = ("claimed", None)
            return self._outcome

    @property
    def done(self) -> bool:
        """Whether this save was committed (or failed) in the background."""
        return self._outcome is not None and self._outcome[0] != "claimed"

    def _run(self) -> None:
        try:
            own = self._own.result()
        except Exception:  # noqa: BLE001 - the collective commit reports rank 0's own error
            return
        found: Dict[int, dict] = {}
        pause = _FIRST_PAUSE_S
        while True:
            if self._outcome is not None:
                return
            for r in self._awaited:
                if r not in found:
                    marker = _read(self.partial, r)
                    if marker is not None:
                        found[r] = marker
            if len(found) == len(self._awaited):
                break
            time.sleep(pause)
            pause = min(2 * pause, _LAST_PAUSE_S)
        results = [own] + [found[r]["result"] if r in found else self._empty for r in range(1, self._size)]
        errors = [None] + [found[r]["error"] if r in found else None for r in range(1, self._size)]
        with self._lock:
            if self._outcome is not None:
                return
            error = self._finish([res if res is not None else self._empty for res in results], errors)
            self._outcome = ("failed", error) if error else ("committed", None)
