"""Real Slurm across the fake nodes: slurmctld on node1, one slurmd in each node's namespaces.

The same daemons and settings as the one-node :class:`LocalSlurm`, with the
nodes of ``scripts/cluster.sh`` (``NodeName=node[1-N]`` at their 198.18.0.x
addresses) in place of this host.  Everything Slurm writes (state, spool, pid
files, logs) lives in the cluster's shared directory, which every node sees;
client commands (sbatch, squeue, scontrol) run on node1, the only place the
controller can be reached from.  The nodes' own /tmp is private, so job
output and checkpoints belong in the shared directory too.
"""
from __future__ import annotations

from typing import List

from cluster_nodes import NODES, SCRIPT, Cluster
from slurm_cluster import NODE_CPUS, LocalSlurm, memory_mb

SUBNET = "198.18.0"


class NodesSlurm(LocalSlurm):
    """Slurm on the ``NODES`` nodes of ``cluster`` (call :meth:`start`, then :meth:`stop`)."""

    def __init__(self, cluster: Cluster):
        super().__init__(cluster.shared / "slurm")
        self.env.update(cluster.env)               # cluster.sh finds the nodes through HPCTRAIN_CLUSTER_DIR
        self.client = self._on("node1")

    @staticmethod
    def _on(node: str) -> List[str]:
        return [str(SCRIPT), "exec", node]

    def _daemons(self):
        return [(self._on("node1"), "slurmctld")] + [(self._on(f"node{i}"), "slurmd") for i in range(1, NODES + 1)]

    def _conf_nodes(self) -> List[str]:
        d, nodes = self.dir, f"node[1-{NODES}]"
        return [
            "ClusterName=hpctrain-nodes",
            f"SlurmctldHost=node1({SUBNET}.1)", "SlurmctldPort=6817", "SlurmdPort=6818",
            f"SlurmdSpoolDir={d / 'spool'}/%n", f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            f"NodeName={nodes} NodeAddr={SUBNET}.[1-{NODES}] CPUs={NODE_CPUS} RealMemory={memory_mb() // NODES} "
            "State=UNKNOWN",
            f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]
