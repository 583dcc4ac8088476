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
older by less than the commit interval.  A value spread over the ranks (a
sharded optimizer) is kept as each rank's part and its copy on the buddy
rank (of another node): a commit counts only when a part of every rank of
the world that made it is on some node, and every rank gathers them all to
take its chunks of the new world.  A state holding values that are not data
writes nothing there (one warning), and starts from what the program loaded.

Cost at a start: one all-gather of the parts' names, and when one is loaded
one read of it, one broadcast of its bytes (the state's size) and a
CRC-32 pass on each rank; a spread value's parts pass through every rank
once (an all-gather).
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .. import settings
from ..checkpoint.node_storage import NodeFolder
from ..checkpoint.state import unpack
from .state import SPREAD_COMMON
from ..errors import CheckpointError, WorldFailedError

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


def _key(record: Dict[str, Any]) -> Tuple[int, int, int, int, int, str, int]:
    return (record["generation"], record["epoch"], record["number"], record["rank"], record["size"], record["value"],
            record["by"])


def _complete(cid: Id, keys: List[Tuple[int, ...]], spread: List[str]) -> bool:
    """Whether ``keys`` (every rank's) hold the main part of commit ``cid`` and, for each spread value, a part of
    every rank of the world that made it (its own or its buddy's copy)."""
    mains = [k for k in keys if tuple(k[:3]) == cid and not k[5]]
    if not mains:
        return False
    size = mains[0][4]
    return all({k[3] for k in keys if tuple(k[:3]) == cid and k[5] == name} >= set(range(size)) for name in spread)


def _load_newest(state, comm, folder: NodeFolder, records: List[Dict[str, Any]],
                 seen: List[List[Tuple[int, ...]]]) -> Optional[Dict[str, Any]]:
    """Load the newest commit whose every needed part is intact on some node (module docstring); None if none."""
    everything = [tuple(k) for keys in seen for k in keys]
    spread_of = {}          # commit -> its spread values (the main parts' records say)
    for rec in records:
        if not rec["value"]:
            spread_of[_key(rec)[:3]] = list(rec.get("spread", []))
    spread_of = {tuple(k): v for k, v in _merge(comm.allgather_object(sorted(spread_of.items())))}
    ids = sorted((cid for cid in spread_of if _complete(cid, everything, spread_of[cid])), reverse=True)
    for cid in ids:
        parts = {name: _gather_parts(comm, folder, records, cid, name) for name in spread_of[cid]}
        size = next(k[4] for k in everything if tuple(k[:3]) == cid and not k[5])
        if any(set(got) != set(range(size)) for got in parts.values()):
            continue        # (a copy failed its CRC-32 and no other was left: an older commit)
        holders = [r for r, keys in enumerate(seen) if any(tuple(k[:3]) == cid and not k[5] for k in keys)]
        mine = {rec["rank"]: rec for rec in records if _key(rec)[:3] == cid and not rec["value"]}
        for root in holders:
            raw, record = None, None
            if comm.rank == root:
                record = mine.get(comm.rank) or mine[min(mine)]
                try:
                    raw = folder.read(record)
                except (OSError, ValueError) as exc:
                    sys.stderr.write(f"hpctrain: node-local commit part {record['stem']} is not used: {exc}\n")
            head = comm.broadcast_object(None if raw is None else (record["rank"], record["crc"], int(raw.size)),
                                         root=root)
            if head is None:
                continue
            sent_rank, crc, nbytes = head
            raw = comm.broadcast(raw if comm.rank == root else np.empty(nbytes, dtype=np.uint8), root=root)
            values = unpack(raw, crc)
            _apply(state, folder, values, mine.get(comm.rank) if sent_rank != comm.rank else None,
                   own_sent=sent_rank == comm.rank)
            for name, got in parts.items():
                _load_spread(state, folder, name, values[SPREAD_COMMON + name], got)
            state.set_commit_number(cid[2])
            if comm.rank == 0:
                sys.stderr.write(f"hpctrain: resumed from node-local commit {cid[2]} (made by {size} ranks; job "
                                 f"{folder.job} in {folder.user_dir}), not from what the program loaded; "
                                 f"HPCTRAIN_NODE_COMMITS=0 turns this off\n")
                sys.stderr.flush()
            return {"number": cid[2], "generation": cid[0], "size": size}
    return None


def _merge(lists: List[List[Tuple[Any, Any]]]) -> List[Tuple[Any, Any]]:
    out: Dict[Any, Any] = {}
    for items in lists:
        for key, value in items:
            out.setdefault(tuple(key), value)
    return list(out.items())


def _gather_parts(comm, folder: NodeFolder, records: List[Dict[str, Any]], cid: Id, name: str) -> Dict[int, Any]:
    """Every old rank's part of spread value ``name`` of commit ``cid``, on every rank (collective): each rank reads
    its share of its node's copies (own or a buddy's), all are gathered, and the first intact one of each old rank
    is taken (checked against its CRC-32)."""
    local = comm.topology
    offer = {}
    for rec in sorted(records, key=lambda r: (r["rank"], r["by"])):
        if _key(rec)[:3] != cid or rec["value"] != name or rec["rank"] in offer:
            continue
        if rec["rank"] % max(local.local_size, 1) != local.local_rank:
            continue        # (another rank of this node reads it)
        try:
            offer[rec["rank"]] = (folder.read(rec).tobytes(), rec["crc"])
        except (OSError, ValueError):
            continue
    got: Dict[int, Any] = {}
    for offered in comm.allgather_object(offer):
        for r, (raw, crc) in offered.items():
            if r not in got:
                try:
                    got[r] = unpack(np.frombuffer(raw, dtype=np.uint8), crc)
                except ValueError:
                    continue
    return got


def _load_spread(state, folder: NodeFolder, name: str, common: Any, parts: Dict[int, Any]) -> None:
    """Give spread value ``name`` (a sharded optimizer) the chunks of this world from the old world's parts."""
    try:
        getattr(state, name).load_shard_state_dict(common, parts.__getitem__)
    except Exception as exc:        # noqa: BLE001 - the program's objects refused the commit: say where it is
        raise _misfit(folder, exc) from exc


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
        raise _misfit(folder, exc) from exc


def _misfit(folder: NodeFolder, exc: Exception) -> CheckpointError:
    """The one-line error, alike on every rank, of a node-local commit the program's objects refused."""
    return CheckpointError(f"a node-local commit of this job ({folder.path}) does not fit the program's state "
                         f"({type(exc).__name__}: {exc}); remove that folder, or set HPCTRAIN_NODE_COMMITS=0, "
                         f"or HPCTRAIN_JOB_ID to another name")
