"""The files of one checkpoint on disk: this rank's tensor files, the manifest, verified reads.

A checkpoint of step N is a directory ``step-<N>`` holding ``replicated.safetensors``
(written by rank 0), ``shard-<id>.safetensors`` (one per shard id, written by its
lowest rank) and ``manifest.json`` (format, step, layout, versions, every file's
size and CRC-32).  It is written as ``step-<N>.partial`` and renamed once the
manifest is in it (:func:`write_manifest`).  :func:`read_entries` checks sizes
and checksums against the manifest before it decodes anything; nothing is
unpickled.  Cost: one pass over the bytes to write or read them, plus CRC-32.
"""
from __future__ import annotations

import datetime
import errno
import json
import os
import platform
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ..errors import format_ranks
from .state import decode
from .tensorfile import CorruptFileError, crc32, read_tensors, write_tensors

__all__ = ["FORMAT", "Sharded", "Mismatch", "write_files", "write_manifest", "read_entries", "compare_replicas",
           "by_rank", "failed_on", "describe_error", "fsync_dir", "split_spread", "read_spread", "SPREAD"]

FORMAT = "hpctrain-checkpoint/1"


class Sharded:
    """Mark a state entry as rank-specific: each shard is written by its owner and restored by its rank.

    Args:
        obj: the entry (anything a state entry may be).
        shard: the shard id (default: the rank in the manager's communicator).
            Ranks passing the same id must hold the same data (pipeline-stage
            replicas, say); the lowest such rank writes it.
        missing: what ``restore`` does when the checkpoint has no shard with
            this id (it was written with another layout), or that shard has no
            such entry (written by an older version): ``"error"`` (default)
            or ``"skip"`` (keep the live value; right for RNG states).
    """

    def __init__(self, obj: Any, shard: Optional[int] = None, missing: str = "error"):
        if missing not in ("error", "skip"):
            raise ValueError(f"missing must be 'error' or 'skip', got {missing!r}")
        if shard is not None and (not isinstance(shard, int) or shard < 0):
            raise ValueError(f"shard must be a non-negative int, got {shard!r}")
        self.obj, self.shard, self.missing = obj, shard, missing


SPREAD = "spread:"      # the shard-file key of an entry whose state is spread over the ranks (a ShardedOptimizer)


def split_spread(state: Mapping[str, Any], replicated: Dict[str, Any], sharded: Dict[str, Any], rank: int) -> List[str]:
    """Write each entry spread over the ranks (``hpctrain_state_spans_ranks``, with ``shard_state_dict()``) as
    its common part in ``replicated`` and this rank's part in ``sharded`` (its shard file, id = rank); return their keys.

    Not when some :class:`Sharded` entry has an id other than the rank (one
    shard file per rank): those entries are then gathered whole instead.
    """
    keys = [k for k, v in replicated.items() if getattr(v, "hpctrain_state_spans_ranks", False)
            and callable(getattr(v, "shard_state_dict", None))]
    if not keys or any(isinstance(v, Sharded) and v.shard not in (None, rank) for v in state.values()):
        return []
    for k in keys:
        replicated[k], sharded[SPREAD + k] = replicated[k].shard_state_dict()
    return keys


def read_spread(path: str, key: str, rank: int) -> Any:
    """The part a rank wrote of spread entry ``key`` (:func:`split_spread`), read from its shard file and verified."""
    with open(os.path.join(path, "manifest.json")) as f:
        files = json.load(f)["files"]
    fname = f"shard-{rank}.safetensors"
    info = files.get(fname)
    if not isinstance(info, dict) or not {"size", "crc32"} <= set(info):
        raise CorruptFileError(f"{path}/manifest.json lists no {fname} (the shard of rank {rank} of a spread state)")
    tensors, metadata = read_tensors(os.path.join(path, fname), info["size"], info["crc32"])
    tree = json.loads(metadata["hpctrain.tree"])
    if SPREAD + key not in tree:
        raise Mismatch(f"checkpoint {path}: {fname} has no part of {key!r}")
    return decode(tree[SPREAD + key]["value"], tensors)


def write_manifest(partial: str, final: str, step: int, world_size: int, results: List[dict]) -> None:
    """Write ``manifest.json`` into ``partial`` (temporary name, fsync, rename), then rename ``partial``
    to ``final`` and fsync the parent: the checkpoint exists from that rename on."""
    files: Dict[str, dict] = {}
    for res in results:
        files.update(res["files"])
    meta = results[0]["meta"]
    manifest = {
        "format": FORMAT, "step": step,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world_size, "shard_of_rank": meta["shard_of_rank"],
        "replicated": meta["replicated"], "sharded": meta["sharded"], "checksum": "crc32",
        "files": files, "versions": _versions(),
    }
    tmp = os.path.join(partial, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(partial, "manifest.json"))
    fsync_dir(partial)
    os.rename(partial, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def read_entries(path: str, step: int, state: Mapping[str, Any], rank: int) -> Dict[str, Tuple[str, Any]]:
    """Read and verify what ``rank`` needs of ``state`` from the checkpoint of ``step`` in ``path``.

    Returns {key: (kind, value)}; an entry spread over the ranks (:func:`split_spread`) has kind ``"spread"``
    and its common part as value (:func:`read_spread` reads a saved rank's part).  Raises CorruptFileError for a
    manifest or file that does not match, :class:`Mismatch` for an intact checkpoint that does not fit ``state``.
    """
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
    except ValueError as exc:
        raise CorruptFileError(f"{path}/manifest.json is not valid JSON ({exc})") from None
    _check_manifest(path, manifest, step)
    files = manifest["files"]
    wanted_rep = [k for k, v in state.items() if not isinstance(v, Sharded)]
    wanted_sh = [k for k, v in state.items() if isinstance(v, Sharded)]
    out: Dict[str, Tuple[str, Any]] = {}

    def load(fname, keys, optional=()):
        info = files.get(fname)
        if not isinstance(info, dict) or not {"size", "crc32"} <= set(info):
            raise CorruptFileError(f"{path}/manifest.json: its field 'files' has no size and crc32 for {fname} "
                                   f"(it lists {sorted(files)})")
        tensors, metadata = read_tensors(os.path.join(path, fname), info["size"], info["crc32"])
        tree = json.loads(metadata["hpctrain.tree"])
        for k in keys:
            if k not in tree and k in optional:
                continue
            if k not in tree:
                raise Mismatch(f"checkpoint {path} has no entry {k!r} (it has {sorted(tree)})")
            out[k] = (tree[k]["kind"], decode(tree[k]["value"], tensors))

    if wanted_rep:
        load("replicated.safetensors", wanted_rep)
        spread = {k[len(SPREAD):] for k in manifest.get("sharded", []) if isinstance(k, str) and k.startswith(SPREAD)}
        for k in set(wanted_rep) & spread:      # (its common part: each saved rank's own part is in its shard file)
            out[k] = ("spread", out[k][1])
    if wanted_sh:
        ids = {state[k].shard if state[k].shard is not None else rank for k in wanted_sh}
        (shard,) = ids
        fname = f"shard-{shard}.safetensors"
        if fname in files:
            load(fname, wanted_sh, [k for k in wanted_sh if state[k].missing == "skip"])
        elif any(state[k].missing == "error" for k in wanted_sh):
            written = sorted(set(s for s in manifest["shard_of_rank"] if s is not None))
            raise Mismatch(f"checkpoint {path} has no shard {shard} (it was written with shards {written} "
                           f"by {manifest['world_size']} ranks)")
    return out


_FIELDS = {"format": str, "step": int, "world_size": int, "shard_of_rank": list, "files": dict}
_KIND_NAMES = {str: "text", int: "whole number", list: "list", dict: "JSON object"}


def _check_manifest(path: str, manifest: Any, step: int) -> None:
    """Raise CorruptFileError naming the field of ``manifest`` that is missing or disagrees, and with what."""
    where = f"{path}/manifest.json"
    if not isinstance(manifest, dict):
        raise CorruptFileError(f"{where} holds a {type(manifest).__name__}, expected a JSON object")
    for field, kind in _FIELDS.items():
        if field not in manifest:
            raise CorruptFileError(f"{where} lacks the field {field!r}")
        if not isinstance(manifest[field], kind) or (kind is int and isinstance(manifest[field], bool)):
            raise CorruptFileError(f"{where}: field {field!r} is {manifest[field]!r}, expected a {_KIND_NAMES[kind]}")
    if manifest["format"] != FORMAT:
        raise CorruptFileError(f"{where}: field 'format' is {manifest['format']!r}, expected {FORMAT!r} "
                               f"(written by another program or another version)")
    if manifest["step"] != step:
        raise CorruptFileError(f"{where}: field 'step' is {manifest['step']}, but the directory "
                               f"{os.path.basename(path)} is the checkpoint of step {step}")


class Mismatch(Exception):
    """The checkpoint is intact but does not fit the state or layout being restored."""


def write_files(partial: str, jobs, meta: dict) -> dict:
    """Write this rank's files (the write step); return their sizes and checksums."""
    files, replica_crcs = {}, {}
    for fname, tensors, tree, write in jobs:
        if fname == "replicated.safetensors":
            replica_crcs = _entry_crcs(tensors, tree)
        if write:
            size, crc = write_tensors(os.path.join(partial, fname), tensors,
                                      {"hpctrain.tree": json.dumps(tree, separators=(",", ":"))})
            files[fname] = {"size": size, "crc32": crc}
    return {"files": files, "replica_crcs": replica_crcs, "meta": meta}


def _entry_crcs(tensors, tree) -> Dict[str, int]:
    """CRC-32 of every replicated entry (its JSON tree and the bytes of its tensors)."""
    out = {}
    for key, node in tree.items():
        text = json.dumps(node, separators=(",", ":"))
        crc = crc32(text.encode())
        for name in re.findall(r'"\$tensor":"(t\d+)"', text):
            crc = crc32(memoryview(np.ascontiguousarray(tensors[name][0]).reshape(-1).view(np.uint8)), crc)
        out[key] = crc
    return out


def compare_replicas(results: List[Optional[dict]]) -> str:
    """Describe the replicated entries whose checksums differ between ranks ("" if none)."""
    crcs = [(r, res["replica_crcs"]) for r, res in enumerate(results) if res and res["replica_crcs"]]
    lines = []
    for key in (crcs[0][1] if crcs else {}):
        groups: Dict[int, List[int]] = {}
        for r, c in crcs:
            groups.setdefault(c.get(key), []).append(r)
        if len(groups) > 1:
            lines.append(f"  entry {key!r} differs between " +
                         " / ".join(format_ranks(g) for g in groups.values()))
    if not lines:
        return ""
    return ("replicated entries differ between ranks; rank 0's copy is saved (mark rank-specific state "
            "with hpctrain.checkpoint.Sharded; BatchNorm statistics differ per rank without SyncBatchNorm):\n"
            + "\n".join(lines))


def by_rank(bad: List[Tuple[int, str]]) -> str:
    """Format (rank, error) pairs one line per distinct error, with the ranks that hit it."""
    groups: Dict[str, List[int]] = {}
    for r, e in bad:
        groups.setdefault(e, []).append(r)
    return "\n".join(f"  {format_ranks(rs)}: {e}" for e, rs in groups.items())


_ADVICE = {errno.ENOSPC: "free space there, or keep fewer checkpoints (CheckpointManager(keep=...))",
           errno.EDQUOT: "free space within the quota there, or keep fewer checkpoints (CheckpointManager(keep=...))",
           errno.EROFS: "the file system is read-only: give a checkpoint directory on a writable one",
           errno.EACCES: "this user may not write there: give a checkpoint directory it may write",
           errno.EPERM: "this user may not write there: give a checkpoint directory it may write"}


def describe_error(exc: BaseException) -> str:
    """One line for an error of the checkpoint's files: an OSError as its errno's name, its text, the path and what
    to do about it; anything else as ``Type: message``."""
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        where = f" ({exc.filename})" if exc.filename else ""
        advice = _ADVICE.get(exc.errno)
        return f"{errno.errorcode[exc.errno]}: {exc.strerror}{where}" + (f"; {advice}" if advice else "")
    return f"{type(exc).__name__}: {exc}"


def failed_on(what: str, bad: List[Tuple[int, str]]) -> str:
    """``what`` failed on the ranks of ``bad`` ((rank, error) pairs): one line when they share one error."""
    groups: Dict[str, List[int]] = {}
    for r, e in bad:
        groups.setdefault(e, []).append(r)
    if len(groups) == 1:
        (e, rs), = groups.items()
        return f"{what} ({format_ranks(rs)}: {e})"
    return f"{what}:\n{by_rank(bad)}"


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions() -> Dict[str, str]:
    import sys

    from .. import __version__ as hpctrain_version
    out = {"hpctrain": hpctrain_version, "python": platform.python_version(), "numpy": np.__version__}
    for mod in ("torch", "tensorflow", "keras"):
        if mod in sys.modules:
            out[mod] = getattr(sys.modules[mod], "__version__", "?")
    return out
