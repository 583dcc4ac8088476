"""Finding and loading committed checkpoints: the read side of :class:`~hpctrain.checkpoint.CheckpointManager`.

A checkpoint is committed once its directory ``step-<N>`` holds a
``manifest.json``.  ``restore_newest`` tries them newest first: every rank
reads and verifies its files (sizes and CRC-32 against the manifest), the
ranks exchange what went wrong, and a checkpoint that any rank cannot read is
skipped for the previous one, with a warning naming the ranks and the fault,
and set aside in ``refused/``.  When every checkpoint is refused, restoring is
an error that lists them (starting from scratch would lose their progress)
unless the caller opts in.  A checkpoint that does not fit the state or the
layout is an error, not a fallback.  Nothing is unpickled.  Cost: one read of the rank's files plus two
object all-gathers per candidate.
"""
from __future__ import annotations

import logging
import os
from typing import Any, List, Mapping, Optional, Tuple

from ..errors import CheckpointError
from .layout import Mismatch, Sharded, by_rank
from .spread import load_spread
from .state import load_entry
from .storage import FileStorage, committed_steps, step_path
from .tensorfile import CorruptFileError

__all__ = ["committed_steps", "step_path", "restore_newest"]

log = logging.getLogger("hpctrain")

def restore_newest(comm, storage: FileStorage, state: Mapping[str, Any], step: Optional[int] = None,
                   start_fresh_if_invalid: bool = False) -> Optional[int]:
    """Load the newest valid checkpoint (or that of ``step``) into ``state``; return its step or None (collective).

    Every checkpoint refused on the way (a rank could not read or verify it)
    is moved to ``refused/`` by rank 0, so that later saves of the same steps
    do not collide with it; nothing is deleted.  When the directory holds
    checkpoints and none is usable, ``CheckpointError`` lists each with why it
    was refused, unless ``start_fresh_if_invalid``: then this returns None
    (start from scratch) and says so.  An empty or missing directory returns None.  ``storage`` reads
    (:meth:`FileStorage.read`, :meth:`FileStorage.read_spread`); what is refused is decided here.
    """
    directory = storage.directory
    candidates = comm.broadcast_object(
        [s for s in reversed(storage.list()) if step is None or s == step] if comm.rank == 0 else None)
    if step is not None and not candidates:
        raise CheckpointError(f"no committed checkpoint of step {step} in {directory}")
    refused: List[Tuple[str, str]] = []
    for cand in candidates:
        path = storage.location(cand)
        loaded, err, mismatch = None, None, None
        try:
            loaded = storage.read(cand, state, comm.rank)
        except Mismatch as exc:
            mismatch = str(exc)
        except (CorruptFileError, OSError, ValueError, KeyError, TypeError) as exc:
            err = f"{type(exc).__name__}: {exc}"
        errors = comm.allgather_object((err, mismatch))
        wrong = [(r, m) for r, (_, m) in enumerate(errors) if m]
        if wrong:
            raise CheckpointError(f"checkpoint {path} does not fit this state or layout:\n{by_rank(wrong)}")
        bad = [(r, e) for r, (e, _) in enumerate(errors) if e]
        if bad:
            refused.append((path, by_rank(bad)))
            if comm.rank == 0:
                log.warning("hpctrain: checkpoint %s is not usable, trying an older one:\n%s", path, by_rank(bad))
            continue
        try:
            # (states spread over the ranks last: a local-SGD optimizer puts each rank's own parameters back)
            for key, (kind, value) in sorted(loaded.items(), key=lambda item: item[1][0] == "spread"):
                target = state[key]
                if isinstance(target, Sharded):
                    holder = {key: target.obj}
                    load_entry(holder, key, kind, value)
                    target.obj = holder[key]      # plain values are replaced, not loaded in place
                elif kind == "spread":      # (its common part here, each saved rank's part in its shard file)
                    load_spread(key, target, value, lambda r, key=key, cand=cand: storage.read_spread(cand, key, r))
                else:
                    load_entry(state, key, kind, value)
            err = None
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            err = f"{type(exc).__name__}: {exc}"
        errors = comm.allgather_object(err)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise CheckpointError(f"loading checkpoint {path} into the state failed "
                                  f"(does the state match what was saved?):\n{by_rank(bad)}")
        _set_aside(comm, directory, refused)
        return cand
    if refused:
        listing = "\n".join(f"  {path}:\n    " + why.replace("\n", "\n    ") for path, why in refused)
        if not start_fresh_if_invalid:
            raise CheckpointError(
                f"none of the {len(refused)} checkpoint(s) in {directory} can be restored; refusing to start from "
                f"scratch and lose their progress. Each was refused because:\n{listing}\n"
                f"To start from scratch anyway (they are then moved to {os.path.join(directory, 'refused')}), pass "
                f"start_fresh_if_invalid=True to restore() or set HPCTRAIN_START_FRESH_IF_INVALID=1.")
        _set_aside(comm, directory, refused)
        if comm.rank == 0:
            log.warning("hpctrain: no usable checkpoint in %s; starting from scratch as asked "
                        "(start_fresh_if_invalid); the refused ones are in %s:\n%s", directory,
                        os.path.join(directory, "refused"), listing)
    return None


def _set_aside(comm, directory: str, refused: List[Tuple[str, str]]) -> None:
    """Rank 0 moves the refused checkpoints to ``<directory>/refused/`` (never deleted); errors raise everywhere."""
    if not refused:
        return
    err = None
    if comm.rank == 0:
        try:
            target_dir = os.path.join(directory, "refused")
            os.makedirs(target_dir, exist_ok=True)
            for path, _ in refused:
                target, k = os.path.join(target_dir, os.path.basename(path)), 1
                while os.path.exists(target):
                    target, k = os.path.join(target_dir, f"{os.path.basename(path)}.{k}"), k + 1
                os.rename(path, target)
        except OSError as exc:
            err = f"cannot move refused checkpoints out of {directory}: {exc}"
    err = comm.broadcast_object(err)
    if err:
        raise CheckpointError(err)
