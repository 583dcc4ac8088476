"""Grow the world in place: start ranks on the added hosts with ``MPI_Comm_spawn`` and merge them into the world.

With ``HPCTRAIN_ELASTIC_GROW=spawn``, when the launcher's hosts offer more
slots (:mod:`hpctrain.elastic.hosts`), the ranks, at a commit:

1. spawn the new ranks (collective over the world, rank 0 the root;
   ``MPI_Comm_spawn`` with the hosts as ``host`` and ``PMIX_ADD_HOST``, so that
   a host the runtime did not start with is added to it): the same program and
   arguments, under :mod:`hpctrain.run`, with the launcher's ``HPCTRAIN_*``
   settings (Open MPI hands a spawned job its MCA parameters, not mpirun's
   ``-x`` variables) and ``HPCTRAIN_ELASTIC_JOINING=1``;
2. the new ranks start as a program does (their own world until
   :func:`hpctrain.elastic.run`, whose start merges them, :func:`join_parent`);
   the old ranks wait for them in ``MPI_Intercomm_merge``: old ranks first, in
   their order, then the new ones;
3. every rank makes the merged communicator its world (the old world's
   objects are kept unfreed, as after a re-forming) and runs the
   :func:`~hpctrain.world.on_reform` callbacks;
4. :func:`share_state`: rank 0's commit number, node-commit generation and
   reset count reach the new ranks, every rank takes rank 0's state
   (``state.sync()``, which commits it) and the state's reset callbacks run;
   the old ranks then call the training function again (the
   :class:`WorldGrew` they raised), the new ones call it for the first time.
   No step is lost: the growth happens at a commit, and every rank goes on
   from it.

A state with a value spread over the ranks (a sharded optimizer) grows by the
launcher's restart instead (its chunks would need resharding from the old
ranks' parts), as do a :class:`~hpctrain.tensorflow.KerasState` (a new rank's
Keras optimizer has no variables before its first step), ``hpctrain.horovod``'s
elastic states (Horovod's reset starts its negotiation on every rank), a
change that also removes ranks, and ``HPCTRAIN_ELASTIC_GROW=restart``.  Open MPI must run the job with
``--prtemca state_base_recoverable 1`` (``hpctrain launch --elastic`` passes it):
without it a spawned process that fails or exits without ``MPI_Finalize`` ends
the whole job.

Not the default yet: on two namespace nodes a joined rank killed on the added
node was noticed by no other rank (Open MPI's runtime did not tell the first
job's ranks of the spawned job's failure), and the job waited for
``HPCTRAIN_STALL_TIMEOUT_S``; on one node it re-forms as any failure does.

Cost: the new processes' start (the interpreter, imports, building the
program's objects: the old ranks wait for it), one merge, the new world's
build (as a re-forming's) and one broadcast of the state.
"""
from __future__ import annotations

import os
import sys
import time
from typing import List, Optional, Tuple

from .. import settings
from ..errors import WorldFailedError

__all__ = ["WorldGrew", "joining", "spawn_ranks", "join_parent", "share_state", "grow", "join"]

# What the new ranks need from the old ranks' environment besides the MCA parameters Open MPI passes on.
_FORWARDED = ("OMP_NUM_THREADS", "TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH", "PYTHONHASHSEED", "CUDA_VISIBLE_DEVICES")


class WorldGrew(WorldFailedError):
    """The world grew in place (ranks spawned on added hosts and merged in); the training function starts again."""


def joining() -> bool:
    """Whether this process was spawned to join a running world and has not joined it yet."""
    return bool(settings.get("HPCTRAIN_ELASTIC_JOINING")) and not _JOINED


_JOINED: List[bool] = []


def spawn_ranks(comm, added: List[Tuple[str, int]]):
    """Start the ranks of ``added`` and merge them into ``comm``'s MPI communicator (collective over ``comm``, the
    world); return the merged MPI communicator (errors returned, not fatal)."""
    from mpi4py import MPI

    names = [h for h, k in added for _ in range(k)]
    env = {**settings.present(), **{k: v for k, v in os.environ.items() if k in _FORWARDED}}
    env.update({settings.setting("HPCTRAIN_ELASTIC_JOINING").name: "1",
                settings.setting("HPCTRAIN_ELASTIC_RANK_HOSTS").name: ",".join(names),
                settings.setting("HPCTRAIN_ELASTIC_RESUME").name: "0"})
    argv = [f"{k}={v}" for k, v in sorted(env.items())] + [sys.executable, "-m", "hpctrain.run", *sys.argv]
    info = MPI.Info.Create()
    where = ",".join(f"{h}:{k}" for h, k in added)
    info.Set("host", where)
    info.Set("PMIX_ADD_HOST", where)
    info.Set("wdir", os.getcwd())
    info.Set("map_by", "slot:OVERSUBSCRIBE")      # (a host offered under two names is one node to the runtime)
    info.Set("bind_to", "none")                   # (as the launcher starts the first ranks)
    try:
        inter = comm.mpi_comm.Spawn("/usr/bin/env", args=argv, maxprocs=len(names), info=info, root=0)
    finally:
        info.Free()
    merged = inter.Merge(high=False)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return merged


def join_parent():
    """A spawned rank: merge with the ranks that spawned it (they are waiting in the merge); the merged MPI
    communicator, the old ranks first."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise RuntimeError("this process was told to join a running world (HPCTRAIN_ELASTIC_JOINING) but was not "
                           "spawned by one")
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    _JOINED.append(True)
    return merged


def become_world(merged):
    """Make the merged MPI communicator the world (collective over it); the old world is stopped and kept."""
    from ..comm.backends.mpi import world_over
    from ..world.lifecycle import _replace_world, world
    from .reform import discard

    old = world()
    new = world_over(merged, old.config, "world", owns=True)
    discard(old)
    _replace_world(new)
    return new


def share_state(state, comm, newcomer: bool, record: Optional[dict] = None) -> None:
    """Give every rank rank 0's state and the job's counts, then commit (collective over the grown world ``comm``).

    Every rank numbers the commit one past rank 0's newest, so the old ranks keep theirs too, and the growth
    counts as a recovery (``state.recoveries``: the node-local commits' epoch) and a reset."""
    from ..checkpoint.node_storage import NodeFolder
    from .hosts import record_resets

    counts = comm.broadcast_object({"number": state.commit_number, "generation": state.node_generation(),
                                    "resets": getattr(state, "_resets", 0), "version": _known_version(),
                                    "recoveries": list(getattr(state, "recoveries", [])) + [record]}
                                   if comm.rank == 0 else None)
    state.recoveries = counts["recoveries"]
    state._resets = counts["resets"] + 1
    state.set_commit_number(counts["number"])
    if newcomer:
        _set_known_version(counts["version"])
        if counts["generation"] is not None and settings.get("HPCTRAIN_NODE_COMMITS"):
            folder = NodeFolder(say=comm.topology.local_rank == 0)
            if folder.open():
                state.keep_on_node(folder, counts["generation"])
    state.sync(comm)
    record_resets(state, comm)
    state.on_reset()


def _known_version() -> int:
    from .hosts import news

    reader = news()
    return reader.known if reader is not None else 0


def _set_known_version(version: int) -> None:
    from .hosts import news

    reader = news()
    if reader is not None:
        reader.known = version


def grow(state, comm, added: List[Tuple[str, int]]) -> None:
    """The old ranks' side (collective over the world): spawn, merge, share the state; then raise
    :class:`WorldGrew` for :func:`hpctrain.elastic.run` to call the training function again."""
    start, wall = time.monotonic(), time.time()
    state.release_world()
    merged = spawn_ranks(comm, added)
    new = become_world(merged)
    built = time.monotonic()
    record = {"old_size": comm.size, "new_size": new.size, "lost": [], "formings": [], "shrink_s": 0.0,
              "build_s": built - start, "recover_s": 0.0, "reform_s": built - start,
              "commit": state.commit_number + 1, "failed_at": wall, "grew": [list(a) for a in added]}
    share_state(state, new, newcomer=False, record=record)
    took = time.monotonic() - start
    if new.rank == 0:
        sys.stderr.write(f"hpctrain: the world grew in place from {comm.size} to {new.size} ranks in {took:.2f} s "
                         f"({', '.join(f'{k} on {h}' for h, k in added)}), from commit {state.commit_number}\n")
        sys.stderr.flush()
    raise WorldGrew(f"the world grew from {comm.size} to {new.size} ranks")


def join(state) -> None:
    """The new ranks' side, at the start of :func:`hpctrain.elastic.run`: merge, then share the state."""
    new = become_world(join_parent())
    share_state(state, new, newcomer=True)


