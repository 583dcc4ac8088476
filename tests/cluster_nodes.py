"""Fake cluster nodes for multi-node tests: the namespaces of scripts/cluster.sh, built once per session.

Each node has its own network namespace (a 1 Gbit/s shaped link to a
bridge), hostname, /dev/shm and /tmp; a directory under /run stands for the
cluster's shared file system.  mpirun starts on node1 and reaches the others
through ``cluster.sh agent`` (nsenter) where it would use ssh.  The nodes
belong to this pytest process (``--owner``): they go when the session ends,
also when it is killed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from harness import BIN, REPO

SCRIPT = REPO / "scripts" / "cluster.sh"
NODES = 3
RATE = "1gbit"


def unavailable() -> Optional[str]:
    """Why fake nodes cannot be built here (None when they can)."""
    if os.geteuid() != 0:
        return "fake nodes need root (network and mount namespaces)"
    for tool in ("unshare", "nsenter", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"fake nodes need {tool}, which is not installed"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"this machine refuses new namespaces: {probe.stderr.strip()}"
    return None


class Cluster:
    """Nodes node1..node``NODES`` that ``scripts/cluster.sh up`` built in ``directory``."""

    def __init__(self, directory: str):
        self.directory = directory
        self.shared = Path(directory) / "shared"
        self.env = {"HPCTRAIN_CLUSTER_DIR": directory}

    @classmethod
    def up(cls) -> "Cluster":
        directory = f"/run/hpctrain-cluster-pytest-{os.getpid()}"
        cluster = cls(directory)
        subprocess.run([str(SCRIPT), "up", str(NODES), "--rate", RATE, "--keep", str(REPO), "--owner",
                        str(os.getpid())], env={**os.environ, **cluster.env}, check=True, capture_output=True,
                       text=True, timeout=120)
        return cluster

    def down(self) -> None:
        subprocess.run([str(SCRIPT), "down"], env={**os.environ, **self.env}, capture_output=True, timeout=120)

    def kill(self, node: str, pattern: str = "") -> None:
        """SIGKILL, at once, every process on ``node`` (whose command line matches ``pattern``, if given)."""
        subprocess.run([str(SCRIPT), "kill", node] + ([pattern] if pattern else []), env={**os.environ, **self.env},
                       check=True, capture_output=True, timeout=30)

    def fault(self, action: str, node: str) -> None:
        """``freeze`` (SIGSTOP every process), ``thaw``, ``cut`` (its link down) or ``heal`` ``node``: cluster.sh."""
        subprocess.run([str(SCRIPT), action, node], env={**os.environ, **self.env}, check=True, capture_output=True,
                       timeout=30)

    def processes(self, node: str, pattern: str) -> list:
        """The command lines of ``node``'s processes that match ``pattern`` (grep -E)."""
        res = subprocess.run([str(SCRIPT), "processes", node, pattern], env={**os.environ, **self.env},
                             capture_output=True, text=True, timeout=30, check=True)
        return res.stdout.splitlines()

    def launcher(self, node: str) -> list:
        """The command prefix that runs a launcher (hpctrain launch, mpirun) on ``node``, reaching the others."""
        return [str(SCRIPT), "launcher", node]

    def mpirun(self, nodes: int, per_node: int) -> list:
        """mpirun from node1 over ``nodes`` nodes with ``per_node`` ranks each (ranks fill node1 first)."""
        hosts = ",".join(f"node{i}:{per_node}" for i in range(1, nodes + 1))
        return ["env", f"MPIRUN={BIN / 'mpirun'}", str(SCRIPT), "mpirun", "-H", hosts, "--output", "tag"]
