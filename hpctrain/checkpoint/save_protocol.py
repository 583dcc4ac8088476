"""How a save ends: every rank's write result gathered, rank 0 commits (or removes) it, errors raised everywhere.

A mixin of :class:`hpctrain.checkpoint.manager.CheckpointManager` (uses its
``comm``, ``keep``, ``verify_replicas``, ``_pending`` and ``storage``, whose
named steps put the bytes in place: :mod:`hpctrain.checkpoint.storage`).  The protocol, in named steps: ``_write`` (each rank's
files, on its writer thread; with markers, rank 0 hears of it at once),
``_commit`` (an allgather of the write results; rank 0 claims the commit
unless its background committer did), ``_finalize`` (replicas compared,
markers removed, the manifest written last under its final name, old steps
pruned), and ``_raise_any`` (one rank's error is every rank's
:class:`~hpctrain.errors.CheckpointError`; nothing partial is left).
"""
from __future__ import annotations

import logging
from typing import List, Optional

from ..errors import CheckpointError
from .background_commit import post_written, remove_markers
from .layout import compare_replicas, describe_error, failed_on

__all__ = ["CommitSteps"]

log = logging.getLogger("hpctrain")


class CommitSteps:
    """The write and commit steps of one manager's saves (see the module docstring)."""

    def _raise_any(self, step: int, partial: str, errors: List[Optional[str]]) -> None:
        """Raise CheckpointError on every rank if any rank reported an error (rank 0 aborts the step)."""
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            if self.comm.rank == 0:
                self.storage.abort(step)
            raise CheckpointError(failed_on(f"checkpoint of step {step} failed; nothing was committed", bad))

    def _write(self, step: int, jobs, meta: dict, marker: bool) -> dict:
        """The write step of an asynchronous save (writer thread); with ``marker``, then tell rank 0 it is done."""
        partial = self.storage.partial(step)
        try:
            result = self.storage.write_part(step, jobs, meta)
        except Exception as exc:
            if marker:
                post_written(partial, self.comm.rank, None, describe_error(exc))
            raise
        if marker:
            post_written(partial, self.comm.rank, result, None)
        return result

    def _finish_pending(self) -> None:
        if self._pending is not None:
            self._pending.future.exception()   # wait for this rank's write
            self._commit()

    def _commit(self) -> None:
        """Gather every rank's write result; rank 0 commits (unless it did in the background); errors raise everywhere."""
        pending, self._pending = self._pending, None
        comm = self.comm
        try:
            result, err = pending.future.result(), None
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            result, err = None, describe_error(exc)
        results = comm.allgather_object((result, err))
        verdict = None
        if comm.rank == 0:
            done, verdict = pending.committer.claim() if pending.committer is not None else ("claimed", None)
            if done == "claimed":
                empty = {"files": {}, "replica_crcs": {}, "meta": None}
                verdict = self._finalize(pending.step, pending.partial, [res or empty for res, _ in results],
                                         [e for _, e in results])
        verdict = comm.broadcast_object(verdict)
        if verdict:
            raise CheckpointError(verdict)

    def _finalize(self, step: int, partial: str, results: List[dict], errors: List[Optional[str]]) -> Optional[str]:
        """Rank 0: commit the save of ``step`` from every rank's result, or remove it; return the error, if any."""
        errors = list(errors)
        replica_msg = compare_replicas(results)
        if replica_msg and self.verify_replicas == "error":
            errors[0] = errors[0] or replica_msg
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            self.storage.abort(step)
            return failed_on(f"checkpoint of step {step} in {self.directory} failed; nothing was committed", bad)
        if replica_msg:
            log.warning("hpctrain: checkpoint of step %d: %s", step, replica_msg)
        try:
            remove_markers(partial, range(self.comm.size))
            self.storage.commit(step, self.comm.size, [res for res in results if res.get("meta") is not None])
            self.storage.prune(self.keep)
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            self.storage.abort(step)
            return f"committing the checkpoint of step {step} failed: {describe_error(exc)}"
        return None
