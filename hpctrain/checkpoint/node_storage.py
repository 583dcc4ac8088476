"""Commits kept also in node-local memory that outlives the process: files in a private folder of ``/dev/shm``.

A process's commits (:class:`~hpctrain.checkpoint.storage.MemoryStorage`)
die with it, and a lost node ends the whole Open MPI job: the survivors'
processes too.  :class:`NodeLocalStorage` is that storage with each committed
part also written to a file of the node's memory (``/dev/shm``, a tmpfs), so
that the restart (or a rerun of the job killed whole, or a Slurm requeue on
the same nodes) finds it: :mod:`hpctrain.elastic.node_resume`.

Layout: ``<HPCTRAIN_NODE_COMMIT_DIR>/hpctrain-<uid>/<job>/`` (:func:`job_id`;
the user's folder is ``0700`` and must be the user's own, not a link, or
nothing is written there), files ``0600``: a part's bytes in the
checkpoint's encoding (:func:`~hpctrain.checkpoint.state.pack`), in a
``buf-<id>.bin`` the process packs into through a mapping (no copy), or a
``.part`` file (a peer's copy), and its record
``g<generation>-e<epoch>-c<number>-r<rank>of<size>[-s<value>[-by<rank>]].json``
(what it is, the file, its size and CRC-32, the job, the writing process),
renamed into place once the bytes are complete: a part exists only once all
of it does, and its record is deleted before its buffer is used again.  *Generation*: one more than any found when
the job (re)started; *epoch*: re-formings of the world in this start; with
*number* they order the commits of a job (newest: the largest triple).

Space: a buffer's bytes are reserved before use (``posix_fallocate``: a
mapped write past a full tmpfs would be a SIGBUS); a full file system turns
the node-local copies off with one warning (commits stay in memory; never a
crash).  Cost of a commit: none beyond the in-memory commit's for its own
part (the buffers are the files; one small JSON record a commit, on the
helper thread), one write a peer's copy; memory: the same ``kept`` + 1
buffers, in the node's memory instead of the process's.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .. import settings
from .storage import MemoryStorage, _value
from .tensorfile import crc32

__all__ = ["NodeFolder", "NodeLocalStorage", "job_id"]

_STEM = re.compile(r"^g(\d+)-e(\d+)-c(\d+)-r(\d+)of(\d+)(?:-s(\w+?)(?:-by(\d+))?)?$")
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def job_id(env: Optional[Dict[str, str]] = None, argv: Optional[List[str]] = None, cwd: Optional[str] = None) -> str:
    """This job's name among the user's node-local commits: ``HPCTRAIN_JOB_ID`` when set, else the Slurm job (a
    requeue keeps it) with a digest of the folder and command line, else that digest alone (a rerun by hand of the
    same command in the same folder is the same job; another command or folder is another)."""
    env = os.environ if env is None else env
    given = settings.get("HPCTRAIN_JOB_ID", env)
    if given:
        return _SAFE.sub("_", given)[:100]
    what = json.dumps([os.getcwd() if cwd is None else cwd, list(sys.argv if argv is None else argv)])
    digest = hashlib.sha256(what.encode()).hexdigest()[:16]
    slurm = env.get("SLURM_JOB_ID", "")
    return f"slurm-{_SAFE.sub('_', slurm)}-{digest}" if slurm else f"cmd-{digest}"


class NodeFolder:
    """The job's folder of node-local commits (module docstring): checked permissions, space, cleaning."""

    def __init__(self, root: Optional[str] = None, job: Optional[str] = None, say: bool = True):
        root = root or settings.get("HPCTRAIN_NODE_COMMIT_DIR")
        self.user_dir = os.path.join(root, f"hpctrain-{os.getuid()}")
        self.job = job or job_id()
        self.path = os.path.join(self.user_dir, self.job)
        self.usable, self.say = False, say
        self._identity = {"job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                          "started": _started(os.getpid())}

    def open(self) -> bool:
        """Make (or check) the user's and the job's folders; False, with one warning, when they cannot be used."""
        try:
            os.makedirs(self.user_dir, mode=0o700, exist_ok=True)
            info = os.lstat(self.user_dir)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise PermissionError(f"{self.user_dir} is not a folder of this user's alone (mode "
                                      f"{stat.filemode(info.st_mode)}, owner {info.st_uid})")
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self.usable = True
        except OSError as exc:
            self.turn_off(f"cannot use {self.user_dir}: {exc}")
        return self.usable

    def turn_off(self, why: str) -> None:
        """Write no more parts here; say why once (commits stay in this process's memory)."""
        if self.say and (self.usable or not getattr(self, "_said", False)):
            self._said = True
            sys.stderr.write(f"hpctrain: node-local commits are off on {socket.gethostname()} ({why}): commits are "
                             f"kept in memory only, so a lost node goes back to the disk checkpoint\n")
            sys.stderr.flush()
        self.usable = False

    def write(self, stem: str, raw: np.ndarray, crc: int, meta: Dict[str, Any]) -> bool:
        """Write part ``stem`` (its bytes, then its ``.json``); False when the space or the file system refused."""
        if not self.usable:
            return False
        data, tmp = os.path.join(self.path, stem + ".part"), os.path.join(self.path, stem + ".tmp")
        try:
            free = shutil.disk_usage(self.path).free
            if free < raw.nbytes:
                raise OSError(f"{free} bytes free, a part needs {raw.nbytes}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if raw.nbytes:
                    os.posix_fallocate(fd, 0, raw.nbytes)
                with os.fdopen(os.dup(fd), "wb", buffering=0) as f:
                    f.write(memoryview(raw).cast("B"))
            finally:
                os.close(fd)
            os.replace(tmp, data)
            doc = dict(meta, **self._identity, crc=int(crc), nbytes=int(raw.nbytes), time=time.time())
            _write_json(os.path.join(self.path, stem + ".json"), doc)
            return True
        except OSError as exc:
            for name in (tmp, data):
                _unlink(name)
            self.turn_off(f"{type(exc).__name__}: {exc}")
            return False

    def buffer(self, size: int) -> Optional[np.ndarray]:
        """A new file of ``size`` bytes here, reserved and mapped into this process (``np.memmap``: its
        ``filename`` names it); None, with one warning, when the space or the file system refuses."""
        if not self.usable:
            return None
        path = os.path.join(self.path, f"buf-{uuid.uuid4().hex}.bin")
        try:
            free = shutil.disk_usage(self.path).free
            if free < size:
                raise OSError(f"{free} bytes free, a part needs {size}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)     # (a mapped write past a full tmpfs would be a SIGBUS)
            finally:
                os.close(fd)
            return np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
        except OSError as exc:
            _unlink(path)
            self.turn_off(f"{type(exc).__name__}: {exc}")
            return None

    def record(self, stem: str, raw: np.ndarray, crc: int, meta: Dict[str, Any]) -> None:
        """Write the record of part ``stem`` whose bytes are ``raw``, a view of a :meth:`buffer`."""
        try:
            doc = dict(meta, **self._identity, crc=int(crc), nbytes=int(raw.size), time=time.time(),
                       data=os.path.basename(raw.filename))
            _write_json(os.path.join(self.path, stem + ".json"), doc)
        except OSError as exc:
            self.turn_off(f"{type(exc).__name__}: {exc}")

    def delete(self, stem: str) -> None:
        """Remove part ``stem`` (its ``.json`` first: never a record without its bytes)."""
        for ext in (".json", ".part"):
            _unlink(os.path.join(self.path, stem + ext))

    def parts(self) -> List[Dict[str, Any]]:
        """The records of the job's parts on this node (each with its ``stem``), unordered; a record that does not
        parse or names another job is left out."""
        out = []
        try:
            names = os.listdir(self.path)
        except OSError:
            return out
        for name in names:
            stem, ext = os.path.splitext(name)
            m = _STEM.match(stem)
            if ext != ".json" or m is None:
                continue
            try:
                with open(os.path.join(self.path, name)) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(doc, dict) or doc.get("job") != self.job:
                continue
            g, e, c, r, s = map(int, m.groups()[:5])
            doc.update(stem=stem, generation=g, epoch=e, number=c, rank=r, size=s, value=m.group(6) or "",
                       by=int(m.group(7)) if m.group(7) else -1)
            out.append(doc)
        return out

    def read(self, record: Dict[str, Any]) -> np.ndarray:
        """The bytes of part ``record`` (from :meth:`parts`), checked against its size and CRC-32 (ValueError)."""
        data = record.get("data") or record["stem"] + ".part"
        if os.path.basename(data) != data:
            raise ValueError(f"node-local part {record['stem']} names a file elsewhere: {data}")
        raw = np.fromfile(os.path.join(self.path, data), dtype=np.uint8, count=int(record["nbytes"]))
        if raw.size != record["nbytes"] or crc32(raw) != record["crc"]:
            raise ValueError(f"node-local part {record['stem']} does not match its record (size or CRC-32)")
        return raw

    def drop_older(self, generation: int) -> None:
        """Remove the job's parts of generations before ``generation`` (a newer start has committed)."""
        for record in self.parts():
            if record["generation"] < generation:
                self.delete(record["stem"])
                if record.get("data"):
                    _unlink(os.path.join(self.path, os.path.basename(str(record["data"]))))

    def remove(self) -> None:
        """Remove the job's folder (the job ended)."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.usable = False

    def clean_stale(self, grace_s: float) -> List[str]:
        """Remove other jobs' folders of this user whose processes on this host are all gone and whose newest file
        is older than ``grace_s`` (a restart of that job had time to take it); return their names."""
        gone = []
        try:
            names = os.listdir(self.user_dir)
        except OSError:
            return gone
        for name in names:
            path = os.path.join(self.user_dir, name)
            if name == self.job or not os.path.isdir(path) or os.path.islink(path):
                continue
            if _newest_mtime(path) > time.time() - grace_s or _owner_alive(path):
                continue
            shutil.rmtree(path, ignore_errors=True)
            gone.append(name)
        return gone


class NodeLocalStorage(MemoryStorage):
    """:class:`~hpctrain.checkpoint.storage.MemoryStorage` whose buffers are files of a :class:`NodeFolder`.

    A step's bytes are packed straight into a file of the node's memory
    mapped into this process (:meth:`NodeFolder.buffer`; the buffer a removed
    step freed is written into by the next, as in memory): keeping them on
    the node costs no copy.  ``where()`` gives ``(generation, epoch, rank,
    size)`` at each commit (the record's name); the record, naming the file,
    its size and CRC-32, is written on the helper thread once the CRC-32 is
    known (:meth:`_seal`); :meth:`remove` deletes it, after the write, before
    the buffer is used again.  Where the folder cannot be used the buffers are
    plain memory.
    """

    def __init__(self, kept: int, folder: NodeFolder, where: Callable[[], Tuple[int, int, int, int]]):
        super().__init__(kept)
        self.folder, self.where = folder, where
        self._stems: Dict[int, str] = {}
        self._taken: Optional[np.ndarray] = None

    def begin(self, step: int) -> None:
        super().begin(step)
        g, e, r, s = self.where()
        self._stems[step] = f"g{g}-e{e}-c{step}-r{r}of{s}"

    def take_spare(self) -> Optional[np.ndarray]:
        self._taken = super().take_spare()
        return self._taken

    def _allocate(self, size: int) -> np.ndarray:
        old, self._taken = self._taken, None
        if getattr(old, "filename", None):      # (the spare was too small: its file goes)
            _unlink(old.filename)
        buf = self.folder.buffer(size)
        return buf if buf is not None else np.empty(size, dtype=np.uint8)

    def _seal(self, step: int, raw: np.ndarray, held: Dict[str, Any]) -> int:
        crc = crc32(raw)
        stem = self._stems.get(step)
        other = sorted(name for name, value in held.items() if not getattr(value, "on_peers", False))
        if other:       # (values that are not data cannot outlive the process)
            self.folder.turn_off(f"the state holds values that are not data: {', '.join(other)}")
        elif stem is not None and getattr(raw, "filename", None):   # (spread values: their PeerStorage's files)
            self.folder.record(stem, raw, crc, {"spread": sorted(held)})
        return crc

    def abort(self, step: int) -> None:
        super().abort(step)
        self._stems.pop(step, None)

    def remove(self, step: int) -> None:
        kept = self._parts.get(step)
        stem = self._stems.pop(step, None)
        if kept is not None and stem is not None:
            _value(kept[0][1])          # (its record may still be being written)
            self.folder.delete(stem)
        before = self._spare
        super().remove(step)
        if before is not None and self._spare is not before and getattr(before[0], "filename", None):
            _value(before[1])
            _unlink(before[0].filename)     # (a spare replaced by a newer one: its file goes)

    def wait(self) -> None:
        """Wait until every commit's record has been written."""
        for (raw, crc), _ in self._parts.values():
            _value(crc)


def _write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _started(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0


def _newest_mtime(path: str) -> float:
    newest = os.stat(path).st_mtime
    for name in os.listdir(path):
        try:
            newest = max(newest, os.stat(os.path.join(path, name)).st_mtime)
        except OSError:
            continue
    return newest


def _owner_alive(path: str) -> bool:
    """Whether a process that wrote a record in ``path`` runs on this host still (the same process: its start)."""
    host = socket.gethostname()
    for name in os.listdir(path):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(path, name)) as f:
                doc = json.load(f)
            if doc.get("host") == host and abs(_started(int(doc["pid"])) - float(doc["started"])) < 1.0:
                return True
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return False
