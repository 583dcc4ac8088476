"""Go on from the newest commit kept in the nodes' memory when a job starts again; remove them when it ends.

A lost node ends the whole Open MPI job, survivors included; the launcher
starts it again on the nodes left (a Slurm requeue, or a rerun by hand of a
job killed whole, starts it again too).  Every commit of
:func:`hpctrain.elastic.run` is also a file in the node's memory
(:class:`~hpctrain.checkpoint.node_storage.NodeLocalStorage`), so at the
start (:func:`start`, collective) the ranks gather what their nodes hold of
this job, agree on the newest commit ``(generation, epoch, number)`` that some
rank holds a part of, and the lowest such rank reads it (checked against its
CRC-32; a part that fails is passed over for the next holder, then the next
older commit) and broadcasts it.  Every rank takes its values, but for each
rank's own (``local``: its RNG streams), which it takes from its own old
rank's part when its node holds it.  What the program loaded before (a disk
checkpoint) is replaced: a commit is made at least as often as a disk
checkpoint is saved in any sensible setting, so the newest commit is newer, or
older by less than the commit interval.  Parts of values that are not data
(a sharded optimizer's parts, held as objects) are not written, so such a
state starts from what the program loaded, as before.

Cost at a start: one all-gather of the parts' names, and when one is loaded
one read of it, one broadcast of its bytes (the state's size) and a
CRC-32 pass on each rank.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import settings
from ..checkpoint.node_storage import NodeFolder
from ..checkpoint.state import unpack
from ..errors import HpctrainError, WorldFailedError

__all__ = ["start", "finish"]

Id = Tuple[int, int, int]       # (generation, epoch, number): larger is newer


def start(state, comm, resumed: bool) -> Optional[Dict[str, Any]]:
    """Find the job's node-local commits, load the newest into ``state`` unless ``resumed`` (the launcher's restart
    on more hosts loaded its own), and keep the state's commits on the node from now on (collective).

    Returns what was loaded (``number``, ``generation``, ``size``: the world that committed it), else None.
    """
    if not settings.get("HPCTRAIN_NODE_COMMITS"):
        return None
    first_on_node = comm.topology.local_rank == 0
    folder = NodeFolder(say=first_on_node)
    if folder.open() and first_on_node:
        folder.clean_stale(settings.get("HPCTRAIN_NODE_COMMITS_STALE_S"))
    records = folder.parts() if folder.usable else []
    seen = comm.allgather_object([_key(r) for r in records])
    generation = 1 + max((k[0] for keys in seen for k in keys), default=0)
    loaded = None if resumed else _load_newest(state, comm, folder, records, seen)
    state.keep_on_node(folder, generation)
    return loaded


def finish(state, comm) -> None:
    """The job's training ended: wait for the last writes, then the first rank of each node removes the job's
    folder (collective; a world that lost ranks meanwhile leaves it to the next start's cleaning)."""
    folder = state.leave_node()
    if folder is None:
        return
    try:
        comm.barrier()
    except WorldFailedError:
        return
    if comm.topology.local_rank == 0:
        folder.remove()


def _key(record: Dict[str, Any]) -> Tuple[int, int, int, int, int]:
    return record["generation"], record["epoch"], record["number"], record["rank"], record["size"]


def _load_newest(state, comm, folder: NodeFolder, records: List[Dict[str, Any]],
                 seen: List[List[Tuple[int, ...]]]) -> Optional[Dict[str, Any]]:
    """Load the newest commit some rank's node holds an intact part of (module docstring); None if none."""
    ids = sorted({tuple(k[:3]) for keys in seen for k in keys}, reverse=True)
    for cid in ids:
        holders = [r for r, keys in enumerate(seen) if any(tuple(k[:3]) == cid for k in keys)]
        mine = {rec["rank"]: rec for rec in records if _key(rec)[:3] == cid}
        for root in holders:
            raw, record = None, None
            if comm.rank == root:
                record = mine.get(comm.rank) or mine[min(mine)]
                try:
                    raw = folder.read(record)
                except (OSError, ValueError) as exc:
                    sys.stderr.write(f"hpctrain: node-local commit part {record['stem']} is not used: {exc}\n")
            head = comm.broadcast_object(None if raw is None else (record["rank"], record["size"], record["crc"],
                                                                   int(raw.size)), root=root)
            if head is None:
                continue
            sent_rank, size, crc, nbytes = head
            raw = comm.broadcast(raw if comm.rank == root else np.empty(nbytes, dtype=np.uint8), root=root)
            _apply(state, folder, unpack(raw, crc), mine.get(comm.rank) if sent_rank != comm.rank else None,
                   own_sent=sent_rank == comm.rank)
            state.set_commit_number(cid[2])
            if comm.rank == 0:
                sys.stderr.write(f"hpctrain: resumed from node-local commit {cid[2]} (made by {size} ranks; job "
                                 f"{folder.job} in {folder.user_dir}), not from what the program loaded; "
                                 f"HPCTRAIN_NODE_COMMITS=0 turns this off\n")
                sys.stderr.flush()
            return {"number": cid[2], "generation": cid[0], "size": size}
    return None


def _apply(state, folder: NodeFolder, values: Dict[str, Any], own: Optional[Dict[str, Any]], own_sent: bool) -> None:
    """Give ``state`` the shared values of a part and this rank's own values from its own old rank's part (``own``,
    read here unless it is the part sent); own values with no part of this rank's keep what they are."""
    local = set(getattr(state, "_local", ()))
    if not own_sent:
        values = {k: v for k, v in values.items() if k not in local}
        if own is not None and local:
            try:
                mine = unpack(folder.read(own), own["crc"])
                values.update({k: v for k, v in mine.items() if k in local})
            except (OSError, ValueError):
                pass            # (its own values are then this start's, as on a rank that never had a part)
    try:
        state._apply(values)
    except Exception as exc:        # noqa: BLE001 - the program's objects refused the commit: say where it is
        raise HpctrainError(f"a node-local commit of this job ({folder.path}) does not fit the program's state "
                            f"({type(exc).__name__}: {exc}); remove that folder, or set HPCTRAIN_NODE_COMMITS=0, "
                            f"or HPCTRAIN_JOB_ID to another name") from exc
