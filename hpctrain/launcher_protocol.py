"""What the launcher and the ranks of an elastic job tell each other: stdout markers and control files.

Both sides import this module and nothing else of each other: the launcher
(:mod:`hpctrain.launcher.launch`, :mod:`hpctrain.launcher.elastic_driver`, in mpirun's parent
process) and the ranks (:mod:`hpctrain.world`, :mod:`hpctrain.elastic.hosts`).

* Markers: lines rank 0 prints on stdout (:data:`ELASTIC_STARTED` when its
  world is made, :data:`ELASTIC_FINISHED` when the last world ends normally,
  :data:`ELASTIC_RESTARTING` before a restart onto more hosts); the launcher
  reads them from mpirun's output.
* Control folder (``HPCTRAIN_ELASTIC_CONTROL``, :func:`control_dir`): the
  launcher writes :data:`HOSTS_FILE` (the discovery script's hosts, versioned);
  rank 0 writes :data:`WORLD_FILE` (the world's size and hosts, at each start
  and re-forming), :data:`RESETS_FILE` and :data:`RESTART_FILE`; a restart's
  commit is written under :data:`COMMIT_DIR`.  Every file is JSON written
  atomically (:func:`write_json`) and read as None while missing or
  half-written (:func:`read_json`).

Cost: one small file write per start, re-forming or restart; nothing without
``--elastic``.
"""
from __future__ import annotations

import json
import os
import time
from typing import Optional

from . import settings

__all__ = ["ELASTIC_STARTED", "ELASTIC_FINISHED", "ELASTIC_RESTARTING", "HOSTS_FILE", "WORLD_FILE",
           "RESTART_FILE", "RESETS_FILE", "COMMIT_DIR", "control_dir", "discovering", "read_json", "write_json",
           "rank_host", "write_world"]

# What rank 0 of an elastic job prints on stdout when its world is made (hpctrain.init) and, of its last world,
# when it ends normally (hpctrain.world's exit hook): see run_elastic.
ELASTIC_STARTED = "hpctrain: elastic mode:"
ELASTIC_FINISHED = "hpctrain: the elastic job finished"
ELASTIC_RESTARTING = "hpctrain: the elastic job restarts"       # (on more hosts: hpctrain.elastic.hosts)

HOSTS_FILE, WORLD_FILE, RESTART_FILE, COMMIT_DIR = "hosts.json", "world.json", "restart.json", "commit"
RESETS_FILE = "resets.json"


def control_dir() -> Optional[str]:
    """The launcher's control folder (``HPCTRAIN_ELASTIC_CONTROL``), or None on one host (no launcher's watch)."""
    return settings.get("HPCTRAIN_ELASTIC_CONTROL") or None


def discovering() -> bool:
    """Whether the launcher runs a host discovery script (it posts hosts news), not fixed hosts."""
    return control_dir() is not None and settings.get("HPCTRAIN_ELASTIC_HOSTS_VERSION") > 0


def read_json(path: str) -> Optional[dict]:
    """The JSON object in ``path``, or None when it is missing or half-written."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def write_json(path: str, value: dict) -> None:
    """Write ``value`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def rank_host(launch_rank: Optional[int] = None) -> str:
    """This process's host as the discovery script names it (the launcher's list, by the rank it started as)."""
    import socket

    names = [h for h in settings.get("HPCTRAIN_ELASTIC_RANK_HOSTS").split(",") if h]
    if launch_rank is None:
        launch_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))
    return names[launch_rank] if launch_rank < len(names) else socket.gethostname()


def write_world(comm) -> None:
    """Rank 0: tell the discovery launcher the world's size and its ranks' hosts (at each start and re-forming)."""
    if not discovering():
        return
    control = control_dir()
    hosts = comm.allgather_object(rank_host())
    if comm.rank == 0:
        write_json(os.path.join(control, WORLD_FILE), {"size": comm.size, "hosts": hosts, "time": time.time()})
