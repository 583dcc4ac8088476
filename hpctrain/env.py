"""Read rank, size and local layout from the launcher's environment.

Every launcher (OpenMPI's mpirun/prterun, MPICH's hydra mpiexec, Slurm's
srun, horovodrun) publishes the process layout in environment variables
before Python starts.  This module reads them from one table, so that
``hpctrain.init(backend="auto")`` can decide between MPI, Horovod and a
single-process world without importing MPI, and so that tools can print what
was detected.  Nothing here imports an MPI library.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["LaunchInfo", "detect_launcher", "LAUNCHERS"]


@dataclass(frozen=True)
class LaunchInfo:
    """Process layout as published by a launcher.

    ``node_rank`` is the index of this process's node, or None when the
    launcher does not publish it (OpenMPI and MPICH do not; the MPI backend
    then computes it from the shared-memory communicator).
    """

    launcher: str
    rank: int
    size: int
    local_rank: Optional[int] = None
    local_size: Optional[int] = None
    node_rank: Optional[int] = None
    num_nodes: Optional[int] = None

    @property
    def uses_mpi(self) -> bool:
        """Return True when the processes were started by an MPI-capable launcher."""
        return self.launcher != "horovod-gloo"


# One row per launcher: (name, variable that must be present, then the
# variables for rank, size, local rank, local size, node rank, node count).
# The first row whose key variable is set wins, so more specific launchers
# come first: horovodrun in Gloo mode sets HOROVOD_* but no MPI variables,
# while horovodrun in MPI mode sets both and MPI's are authoritative.
LAUNCHERS = (
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None, None),
    ("mpich", "PMI_RANK", "PMI_RANK", "PMI_SIZE",
     "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None, None),
    ("pmix", "PMIX_RANK", "PMIX_RANK", "PMIX_SIZE", None, None, None, None),
    ("horovod-gloo", "HOROVOD_RANK", "HOROVOD_RANK", "HOROVOD_SIZE",
     "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE"),
    # srun sets SLURM_STEP_ID for the tasks of a job step; the batch script
    # itself also has SLURM_PROCID=0 but is not one of N tasks.
    ("slurm", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS",
     "SLURM_LOCALID", None, "SLURM_NODEID", "SLURM_STEP_NUM_NODES"),
)


def _int(env: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    if name is None or name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        return None


def detect_launcher(env: Optional[Mapping[str, str]] = None) -> Optional[LaunchInfo]:
    """Return the layout published by the launcher, or None without one.

    Args:
        env: the environment to read (default ``os.environ``).

    Returns:
        A :class:`LaunchInfo`, or None for a plain ``python script.py``.
    """
    env = os.environ if env is None else env
    for name, key, r, s, lr, ls, nr, nn in LAUNCHERS:
        if key not in env:
            continue
        if name == "slurm" and env.get("SLURM_STEP_ID") in ("batch", "extern", "interactive"):
            continue
        rank, size = _int(env, r), _int(env, s)
        if rank is None:
            continue
        if size is None and name == "pmix":
            size = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(env, ls)
        if name == "slurm":
            local_size = _slurm_local_size(env)
        return LaunchInfo(name, rank, size if size is not None else 1,
                          _int(env, lr), local_size, _int(env, nr), _int(env, nn))
    return None


def _slurm_local_size(env: Mapping[str, str]) -> Optional[int]:
    """Return the task count on this node from SLURM_STEP_TASKS_PER_NODE.

    Slurm writes it compressed, e.g. ``"2(x3),1"`` for three nodes of two
    tasks and one node of one.
    """
    spec, node = env.get("SLURM_STEP_TASKS_PER_NODE"), _int(env, "SLURM_NODEID")
    if not spec or node is None:
        return None
    counts = []
    for part in spec.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts[node] if node < len(counts) else None
