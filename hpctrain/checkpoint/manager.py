"""CheckpointManager: coordinated, atomic, verified, optionally asynchronous checkpoints.

Protocol of one save, as named steps (every rank takes part in each):

1. **plan** (collective): the ranks agree on the step and the entry names, and
   on who writes what.  Replicated entries (the default: pure data parallel)
   are written once, by rank 0; entries wrapped in :class:`Sharded` are
   written by the lowest rank holding each shard id.  Rank 0 creates
   ``step-<N>.partial/``.
2. **snapshot** (local, at the step boundary): the state is encoded into
   arrays plus a JSON tree; with ``async_save`` every array is copied to host
   memory first, so training may change the live state at once.
3. **write** (local; a background thread with ``async_save``): each writer
   streams its safetensors file into the partial directory, with a CRC-32 of
   every byte, and fsyncs it.
4. **commit** (rank 0, as soon as every rank has written: each leaves a
   marker with its result beside its files, :mod:`hpctrain.checkpoint.background_commit`;
   confirmed collectively at the next ``save()``/``wait()``, which commits
   itself if rank 0 has not): any error on any rank makes rank 0 remove the
   partial directory.  Otherwise rank 0 writes ``manifest.json`` (file list,
   sizes, checksums, step, layout, versions) under a temporary name, fsyncs,
   renames it, renames the directory to ``step-<N>``, fsyncs the parent, and
   only then deletes checkpoints beyond ``keep``.  At the confirmation an
   error is raised on every rank.  A failure after the last rank finished
   writing loses only the steps since that save.

A checkpoint exists only once its directory has its final name and holds a
manifest; ``restore`` reads the newest one, checks every file's size and
CRC-32 against the manifest, and falls back to the previous one (saying why)
when anything does not match.  Nothing is unpickled: tensors are safetensors,
everything else JSON.  The directory must be visible to every rank (a shared
file system on several nodes).
"""
from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from .. import settings
from ..agreement import check_same
from ..comm.recording.timeline import span_of
from ..errors import EXIT_PREEMPTED, CheckpointError
from .background_commit import BackgroundCommit
from .save_protocol import CommitSteps
from .hostcopy import HostCopier, default_copy_threads
from .layout import Sharded, describe_error, split_spread
from .restore import restore_newest
from .storage import FileStorage
from .state import encode

__all__ = ["CheckpointManager", "Sharded", "CheckpointError", "EXIT_PREEMPTED"]

log = logging.getLogger("hpctrain")



class _Pending:
    """A save between snapshot and commit (rank 0: with its background commit)."""

    def __init__(self, step: int, partial: str, future: Future, committer: Optional[BackgroundCommit] = None):
        self.step, self.partial, self.future, self.committer = step, partial, future, committer


class CheckpointManager(CommitSteps):
    """Save and restore the training state of every rank together; keep the newest ``keep`` checkpoints.

    Typical loop (the same on every rank)::

        manager = CheckpointManager("ckpt", every_steps=100)
        state = {"model": model, "optimizer": optimizer, "sampler": sampler,
                 "rng": Sharded(RNGState(), missing="skip")}
        start = manager.restore(state) or 0
        for step in range(start, total_steps):
            train_one_step()
            manager.save(step + 1, state)      # saves only when due; cheap otherwise
        manager.wait()

    Args:
        directory: where checkpoints live (shared by all ranks); created if needed.
        keep: how many committed checkpoints to keep (>= 1).
        async_save: copy the state to host memory at the step boundary and
            write it on a background thread while training continues.
        every_steps: with this or ``every_seconds``, ``save()`` saves only when
            ``step % every_steps == 0`` or ``every_seconds`` have passed on
            rank 0 since the last save (or on preemption); with neither, every
            ``save()`` saves.
        every_seconds: see ``every_steps``.
        verify_replicas: ``"warn"`` (default), ``"error"`` or ``"off"``: compare a
            checksum of every replicated entry across ranks when saving (each
            rank computes it on its snapshot, off the critical path).  Entries
            that differ (BatchNorm statistics without SyncBatchNorm, a
            rank-specific RNG) are saved from rank 0; mark such state
            :class:`Sharded` instead.
        copy_threads: threads that copy the state to host memory for an
            asynchronous save (the training stall); default: this rank's
            share of its cores (cores / ranks on the node), at most 8.
        comm: the communicator (default: the world; in elastic mode the manager then follows each re-formed
            world, :meth:`_move_to`).

    Cost of a save: one pass over the state bytes to encode (a copy into
    reused host buffers with ``async_save``, so that memory stays allocated
    between saves, made by ``copy_threads`` threads), one write with CRC-32
    and fsync, a few small collectives.
    ``save()`` calls that do not save cost nothing, or one 3-integer all-reduce
    per call while a write is in flight, ``every_seconds`` is set or preemption
    handling is on.
    """

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True, every_steps: Optional[int] = None,
                 every_seconds: Optional[float] = None, verify_replicas: str = "warn",
                 copy_threads: Optional[int] = None, comm=None):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
            raise ValueError(f"every_steps must be a positive int or None, got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise ValueError(f"every_seconds must be positive or None, got {every_seconds!r}")
        if verify_replicas not in ("warn", "error", "off"):
            raise ValueError(f"verify_replicas must be 'warn', 'error' or 'off', got {verify_replicas!r}")
        follow = comm is None
        if comm is None:
            from .. import world
            comm = world()
        self.comm = comm
        self.storage = FileStorage(directory)       # where the bytes go (storage.py); the steps below decide what
        self.directory = self.storage.directory
        self.keep, self.async_save = keep, async_save
        self.every_steps, self.every_seconds = every_steps, every_seconds
        self.verify_replicas = verify_replicas
        self._pending: Optional[_Pending] = None
        self._staging: Dict[str, Dict[str, np.ndarray]] = {"replicated": {}, "sharded": {}}   # host copies, reused
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-checkpoint")
        self.copy_threads = copy_threads if copy_threads is not None else default_copy_threads(comm.topology.local_size)
        self._copier = HostCopier(self.copy_threads)
        self._last_save_time = time.monotonic()
        self._last_step: Optional[int] = None
        self.signal_received: Optional[int] = None   # set by on_preemption's handler
        self.preemption_armed = False
        self.preempted = False
        self.on_preempted = None                      # called after the preemption save (see on_preemption)
        err = None
        if comm.rank == 0:
            try:
                self.storage.prepare()
            except OSError as exc:
                err = f"cannot use checkpoint directory {self.directory}: {describe_error(exc)}"
        err = comm.broadcast_object(err)
        if err:
            raise CheckpointError(err)
        self._register_with(comm)
        if follow and comm.life.failure_policy.reforms:      # (held weakly: a dropped manager stops following)
            from ..world import on_reform

            on_reform(CheckpointManager._move_to, owner=self)

    def _register_with(self, comm) -> None:
        """Have ``comm``'s close wait for the save in flight, and its interruption say what is saved."""
        comm.on_close(CheckpointManager.wait, f"the checkpoint manager of {self.directory}", owner=self)
        comm.on_interrupt(CheckpointManager.saved, owner=self)

    def _move_to(self, world) -> None:
        """Go on over a re-formed ``world`` (elastic mode; no collective).

        A save in flight is dropped unless it was committed already (rank 0
        of the new world removes its partial folder: the old world cannot
        finish it); the next due ``save()`` writes on the new world, and steps
        done again up to the newest committed one are not saved twice.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending.committer is not None:
                pending.committer.claim()           # (stops rank 0's background commit, or waits for it)
            try:
                pending.future.result()             # (this rank's own write; its error no longer matters)
            except Exception:  # noqa: BLE001
                pass
            if world.rank == 0:
                self.storage.abort(pending.step)
        self.comm = world
        self._last_step = self.latest_step()
        self._register_with(world)

    # -- public API -------------------------------------------------------
    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, kind, value, tb) -> bool:
        if kind is None:
            self.wait()
        return False

    def all_steps(self) -> List[int]:
        """Return the steps of the committed checkpoints, oldest first (not verified)."""
        return self.storage.list()

    def latest_step(self) -> Optional[int]:
        """Return the step of the newest committed checkpoint, or None (its files are checked by ``restore``)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def saved(self) -> str:
        """Say what is saved: the newest committed step and directory, and a save still in flight."""
        latest = self.latest_step()
        said = (f"the newest checkpoint is step {latest} ({self.directory})" if latest is not None
                else f"no checkpoint is committed yet ({self.directory})")
        pending = self._pending
        if pending is not None and pending.step != latest:
            said += f"; the save of step {pending.step} was not finished and is lost"
        return said

    def step_dir(self, step: int) -> str:
        """Return the directory of the checkpoint of ``step``."""
        return self.storage.location(step)

    def save(self, step: int, state: Mapping[str, Any], force: bool = False) -> bool:
        """Save ``state`` as the checkpoint of ``step`` if one is due; return whether a save started.

        Collective: call it on every rank with the same step and entry names.
        Also commits a finished asynchronous save and acts on preemption
        signals (see :func:`hpctrain.checkpoint.on_preemption`).
        """
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        preempt = due_by_time = False
        if self.preemption_armed or self.every_seconds is not None or self._pending is not None:
            busy = self._pending is not None and not self._pending.future.done()
            timed = (self.comm.rank == 0 and self.every_seconds is not None
                     and time.monotonic() - self._last_save_time >= self.every_seconds)
            flags = self.comm.allreduce(np.array([self.signal_received is not None, timed, busy], dtype=np.int64),
                                        op="max")
            preempt, due_by_time, someone_busy = (bool(f) for f in flags)
            if self._pending is not None and not someone_busy:
                self._commit()
        periodic = self.every_steps is not None or self.every_seconds is not None
        due = (force or preempt or due_by_time or not periodic
               or (self.every_steps is not None and step % self.every_steps == 0))
        started = due and step != self._last_step     # never the same step twice
        if started:
            with span_of(self.comm, "checkpoint save", "checkpoint", step=step):
                self._finish_pending()
                self._start(step, state)
        if preempt:
            self.wait()
            self.preempted = True
            self.signal_received = None       # handled: later steps do not save again
            if self.on_preempted is not None:
                self.on_preempted(self)
        return started

    def wait(self) -> None:
        """Finish and commit the save in flight (collective); raise its error on every rank."""
        self._finish_pending()

    def close(self) -> None:
        """Wait for the save in flight and stop the writer thread."""
        self.wait()
        self._pool.shutdown(wait=True)
        self._copier.close()

    def restore(self, state: Mapping[str, Any], step: Optional[int] = None,
                start_fresh_if_invalid: Optional[bool] = None) -> Optional[int]:
        """Load the newest valid checkpoint (or that of ``step``) into ``state``; return its step or None.

        Collective; rank 0 prints "resumed from step N (<directory>)".
        Checkpoints whose files do not match their manifest are skipped with
        a warning and moved to ``refused/`` (never deleted).  When
        the directory holds checkpoints and none is valid, ``CheckpointError``
        lists each with why it was refused (on every rank), unless
        ``start_fresh_if_invalid`` (default: ``HPCTRAIN_START_FRESH_IF_INVALID``):
        then None is returned and training starts from scratch.  An empty or
        missing directory returns None.  Replicated entries restore into any
        world size; :class:`Sharded` entries need their shard id in the
        checkpoint.  Objects are loaded in place (``load_state_dict``, array
        copies); plain values replace the entries of ``state``.
        """
        self.wait()
        if start_fresh_if_invalid is None:
            start_fresh_if_invalid = settings.get("HPCTRAIN_START_FRESH_IF_INVALID")
        found = restore_newest(self.comm, self.storage, state, step, bool(start_fresh_if_invalid))
        if found is not None:
            self._last_step = found
            if self.comm.rank == 0:
                print(f"hpctrain: resumed from step {found} ({self.directory})", file=sys.stderr, flush=True)
        return found

    # -- save steps -----------------------------------------------------------
    def _start(self, step: int, state: Mapping[str, Any]) -> None:
        """Plan, snapshot and write (inline, or handed to the writer thread)."""
        comm = self.comm
        if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
            raise TypeError("state must be a dict with str keys")
        replicated = {k: v for k, v in state.items() if not isinstance(v, Sharded)}
        sharded = {k: v.obj for k, v in state.items() if isinstance(v, Sharded)}
        spread = split_spread(state, replicated, sharded, comm.rank)
        # plan
        check_same(comm, "the checkpoint step and entries", (step, sorted(replicated), sorted(sharded)),
                   f"step {step}, replicated {sorted(replicated)}, sharded {sorted(sharded)}")
        shard_ids = {v.shard if v.shard is not None else comm.rank for v in state.values() if isinstance(v, Sharded)}
        if spread:
            shard_ids.add(comm.rank)
        my_shard = min(shard_ids) if shard_ids else None
        partial = self.storage.partial(step)
        err = None
        if len(shard_ids) > 1:
            err = f"all Sharded entries of one rank must use the same shard id, got {sorted(shard_ids)}"
        elif comm.rank == 0:
            try:
                self.storage.begin(step)
            except OSError as exc:
                err = f"cannot create {partial}: {describe_error(exc)}"
        plan = comm.allgather_object((my_shard, err))
        self._raise_any(step, partial, [e for _, e in plan])
        shard_of_rank = [s for s, _ in plan]
        writes_shard = my_shard is not None and shard_of_rank.index(my_shard) == comm.rank
        verify = self.verify_replicas != "off" and comm.size > 1
        for obj in replicated.values():     # (a ShardedOptimizer beside Sharded entries of other ids: gathered whole)
            if getattr(obj, "hpctrain_state_spans_ranks", False):
                obj.consolidate_state_dict(to=None if verify else 0)
        # snapshot (errors such as an entry that is not data are raised on every rank)
        jobs, err = [], None
        try:
            if comm.rank == 0 or verify:
                tensors, tree = encode(replicated, copy=self.async_save, staging=self._staging["replicated"],
                                       copier=self._copier)
                jobs.append(("replicated.safetensors", tensors, tree, comm.rank == 0))
            if writes_shard:
                tensors, tree = encode(sharded, copy=self.async_save, staging=self._staging["sharded"],
                                       copier=self._copier)
                jobs.append((f"shard-{my_shard}.safetensors", tensors, tree, True))
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            err = f"{type(exc).__name__}: {exc}"
        self._raise_any(step, partial, comm.allgather_object(err))
        meta = {"step": step, "shard_of_rank": shard_of_rank, "replicated": sorted(replicated),
                "sharded": sorted(sharded)}
        self._last_step = step
        self._last_save_time = time.monotonic()
        if self.async_save:
            writers = {shard_of_rank.index(s) for s in set(shard_of_rank) if s is not None} | {0}
            awaited = [r for r in range(1, comm.size) if verify or r in writers]
            future = self._pool.submit(self._write, step, jobs, meta, comm.rank in awaited)
            committer = None
            if comm.rank == 0:
                committer = BackgroundCommit(partial, future, awaited, comm.size,
                                             {"files": {}, "replica_crcs": {}, "meta": meta},
                                             lambda results, errors: self._finalize(step, partial, results, errors))
            self._pending = _Pending(step, partial, future, committer)
        else:
            fut: Future = Future()
            try:
                fut.set_result(self.storage.write_part(step, jobs, meta))
            except BaseException as exc:  # noqa: BLE001 - delivered at commit
                fut.set_exception(exc)
            self._pending = _Pending(step, partial, fut)
            self._commit()
