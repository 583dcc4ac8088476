"""Hosts that come and go (``hpctrain launch --elastic --host-discovery-script S``): the ranks' side.

The launcher (:mod:`hpctrain.launcher.elastic_driver`) runs the discovery script every
second and writes what it offers to ``<control>/hosts.json`` with a version
number (``HPCTRAIN_ELASTIC_CONTROL``); rank 0 of the world writes the world's
size and hosts to ``<control>/world.json`` at each start and re-forming.  At
every commit the state calls :func:`check` (collective: rank 0 reads the file
when it changed and broadcasts the news, one small broadcast per commit), and
when the launcher's version is newer than the one the ranks know, every rank
works out the same plan from the offered ``host: slots`` and the hosts of the
world's ranks (an allgather, only then):

* a rank whose host is gone, or beyond its host's new slot count (the last
  ones of the host go first), leaves: it ends as a failed rank and the others
  re-form without it, from the commit just made (no step lost);
* when the hosts offer more slots than the ranks (up to ``--max-np``) and
  none leaves, with ``HPCTRAIN_ELASTIC_GROW=spawn`` the world grows in place:
  the new ranks are spawned on the added hosts and merged in
  (:mod:`hpctrain.elastic.grow`); by default, and for a state spread over
  the ranks (a sharded optimizer) or a change that also removes ranks, the
  world grows by a restart: every rank writes the commit
  just made (:class:`~hpctrain.checkpoint.CheckpointManager`, into
  ``<control>/commit``), rank 0 marks ``<control>/restart.json`` and every
  rank exits; the launcher starts the job again on the offered hosts and
  :func:`resume` loads that commit before training goes on.

Cost of a commit in discovery mode: one ``stat`` on rank 0 and one broadcast of
a small object; nothing without a discovery script.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from .. import settings
from ..errors import WorldFailedError
from ..launcher_protocol import (COMMIT_DIR, ELASTIC_RESTARTING, HOSTS_FILE, RESETS_FILE, RESTART_FILE,
                                 control_dir, discovering, rank_host, read_json, write_json)

__all__ = ["HostsChanged", "check", "resume", "resuming", "plan", "additions", "record_resets"]



class HostsChanged(WorldFailedError):
    """Ranks left the world because their hosts left the discovery script's list (the others re-form)."""


def plan(offered: Sequence[Tuple[str, int]], hosts: Sequence[str], max_np: int) -> Tuple[List[bool], bool]:
    """Which of the world's ranks stay on the ``offered`` ``(host, slots)``, and whether the world grows.

    ``hosts[r]`` is rank ``r``'s host.  On each host the first ``slots`` ranks
    (in rank order) stay; the world grows when ``min(sum of slots, max_np)``
    exceeds the ranks that stay (``max_np`` 0: no limit).
    """
    slots: Dict[str, int] = {}
    for name, count in offered:
        slots[name] = slots.get(name, 0) + int(count)
    used: Dict[str, int] = {}
    stays = []
    for name in hosts:
        used[name] = used.get(name, 0) + 1
        stays.append(used[name] <= slots.get(name, 0))
    total = sum(slots.values())
    target = min(total, max_np) if max_np else total
    return stays, target > sum(stays)


def additions(offered: Sequence[Tuple[str, int]], hosts: Sequence[str], max_np: int) -> List[Tuple[str, int]]:
    """The ``(host, new ranks)`` that fill the ``offered`` slots beyond the world's ranks (``hosts[r]``: rank r's
    host), in the offered order, up to ``max_np`` ranks in all (0: no limit)."""
    used = {}
    for name in hosts:
        used[name] = used.get(name, 0) + 1
    room = (max_np - len(hosts)) if max_np else sum(int(s) for _, s in offered)
    out = []
    for name, slots in offered:
        free = int(slots) - used.get(name, 0)
        used[name] = used.get(name, 0) + max(free, 0)
        take = min(max(free, 0), room)
        if take > 0:
            out.append((name, take))
            room -= take
    return out


class _News:
    """Rank 0's view of ``<control>/hosts.json``: read again only when its modification time changed."""

    def __init__(self, control: str):
        self.path = os.path.join(control, HOSTS_FILE)
        self.known = settings.get("HPCTRAIN_ELASTIC_HOSTS_VERSION")   # (the version this job was started with)
        self._mtime, self._doc = None, None

    def pending(self) -> Optional[dict]:
        """The launcher's newest hosts when newer than the known ones, else None (not consumed)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return None
        if mtime != self._mtime:
            self._mtime, self._doc = mtime, read_json(self.path)
        doc = self._doc
        return doc if doc is not None and doc.get("version", 0) > self.known else None


_NEWS: List[_News] = []      # this process's reader of the launcher's hosts (one per process: the launcher's news)


def news() -> Optional[_News]:
    """This process's reader of the launcher's hosts file, or None outside discovery mode."""
    if not discovering():
        return None
    if not _NEWS:
        _NEWS.append(_News(control_dir()))
    return _NEWS[0]


def check(state) -> bool:
    """Act on the launcher's newest hosts (collective over the world; module docstring); True when ranks left.

    Returns False when nothing changed.  A rank that must leave ends here (as
    a failed rank); when the world must grow it grows in place and every rank
    raises :class:`~hpctrain.elastic.grow.WorldGrew` (:func:`in_place`), else
    every rank writes ``state`` and exits for the launcher's restart.  True:
    other ranks are leaving, and the caller re-forms the world (from the commit
    just made).
    """
    reader = news()
    if reader is None:
        return False
    from ..world import world

    comm = world()
    doc = state.broadcast_value(comm, reader.pending() if comm.rank == 0 else None)
    if doc is None:
        return False
    reader.known = doc["version"]
    hosts = state.allgather_value(comm, rank_host())
    offered = [tuple(h) for h in doc["hosts"]]
    stays, grow = plan(offered, hosts, settings.get("HPCTRAIN_ELASTIC_MAX_NP"))
    if grow and all(stays) and in_place(state, comm):
        state.grow_in_place(comm, additions(offered, hosts, settings.get("HPCTRAIN_ELASTIC_MAX_NP")))
    if grow:
        _restart(state, comm, doc, hosts)
    if not stays[comm.rank]:
        from ..world import fail_this_rank

        fail_this_rank(f"hpctrain: rank {comm.rank}: its host {hosts[comm.rank]} left the launcher's hosts "
                       f"(the discovery script's, less those left out after a failure) or has fewer slots now")
    if all(stays):
        return False
    comm.life.failure_policy.planned_leave = True     # (the re-forming that follows is no partition's side)
    if comm.rank == stays.index(True):
        gone = sorted({h for h, s in zip(hosts, stays) if not s})
        _say(f"hpctrain: host(s) {', '.join(gone)} left the job (the launcher's hosts): "
             f"{len(stays) - sum(stays)} rank(s) leave, the others go on from commit {state.commit_number}")
    return True


def in_place(state, comm) -> bool:
    """Whether the world grows in place (:mod:`hpctrain.elastic.grow`) rather than by the launcher's restart: with
    HPCTRAIN_ELASTIC_GROW=spawn (not the default yet: across nodes a joined rank's death goes unnoticed), on the MPI
    backend, for a state with no value spread over the ranks (and not under hpctrain.horovod's elastic API, whose
    reset starts its negotiation again on every rank)."""
    return (settings.get("HPCTRAIN_ELASTIC_GROW") == "spawn" and comm.backend == "mpi"
            and getattr(state, "grows_in_place", True) and not getattr(state, "spans_ranks", lambda: True)())


def _restart(state, comm, doc: dict, hosts: Sequence[str]) -> None:
    """Write the newest commit for the launcher's restart on more hosts, then end this process (status 0)."""
    from ..world.lifecycle import _mark_restarting

    control = control_dir()
    start = time.monotonic()
    state.release_world()
    _checkpoint(state, comm).save(state.commit_number, state.checkpoint_entries(), force=True)
    if comm.rank == 0:
        write_json(os.path.join(control, RESTART_FILE),
                   {"commit": state.commit_number, "size": comm.size, "version": doc["version"],
                    "resets": resets_done(state) + 1,
                    "save_s": time.monotonic() - start, "time": time.time()})
        sys.stdout.write(f"{ELASTIC_RESTARTING} from commit {state.commit_number} (written in "
                         f"{time.monotonic() - start:.2f} s): the launcher offers "
                         f"{sum(int(s) for _, s in doc['hosts'])} slot(s) for {comm.size} rank(s)\n")
        sys.stdout.flush()
    comm.barrier()
    _mark_restarting()
    raise SystemExit(0)


def resets_done(state) -> int:
    """Resets of this job so far: re-formings and restarts, across the launcher's restarts on more hosts."""
    return settings.get("HPCTRAIN_ELASTIC_RESETS_DONE") + getattr(state, "_resets", 0)


def _checkpoint(state, comm):
    from ..checkpoint import CheckpointManager

    return CheckpointManager(os.path.join(control_dir(), COMMIT_DIR), keep=1, async_save=False,
                             verify_replicas="off", comm=comm)


def resuming() -> bool:
    """Whether this process was started by the launcher's restart on more hosts and has not loaded its commit."""
    return bool(settings.get("HPCTRAIN_ELASTIC_RESUME")) and not _RESUMED


def resume(state) -> Optional[int]:
    """After the launcher's restart on more hosts: load the commit the ranks wrote into ``state`` (collective).

    Returns the commit number, or None when this job was not restarted so
    (only once per process).
    """
    if not resuming():
        return None
    _RESUMED.append(True)
    from ..world import world

    comm = world()
    entries = state.checkpoint_entries()
    step = _checkpoint(state, comm).restore(entries)
    if step is None:
        return None
    state.load_checkpoint_entries(entries)
    return step


_RESUMED: List[bool] = []       # (a process resumes once: the launcher's restart started it)


def record_resets(state, comm) -> None:
    """Rank 0: tell the launcher the job's resets so far (after each reset), which it counts on after a restart.

    Open MPI ends the whole job when a node's daemon is lost; the launcher
    then starts it again (:mod:`hpctrain.launcher.elastic_driver`), and the
    re-formings before are counted towards the reset limit from this file.
    """
    control = control_dir()
    if control is not None and comm.rank == 0:
        _report(os.path.join(control, RESETS_FILE), {"resets": resets_done(state), "time": time.time()})


def _report(path: str, value: dict) -> None:
    """Write the launcher's file ``path``; with fixed hosts a folder rank 0's host cannot see costs a warning (the
    launcher then counts restarts only), with a discovery script it is an error (every host must see it)."""
    try:
        write_json(path, value)
    except OSError as exc:
        if discovering():
            raise
        if not _WARNED:
            _WARNED.append(True)
            _say(f"hpctrain: cannot write the elastic launcher's {os.path.basename(path)} ({exc}): rank 0's host "
                 f"does not see the launcher's folder, so a restart after a lost node counts only the restarts "
                 f"towards the reset limit")


_WARNED: List[bool] = []


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
