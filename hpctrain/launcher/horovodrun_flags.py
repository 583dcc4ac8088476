"""horovodrun's flags that ``hpctrain launch`` does not take, and the one line that refuses each.

``hpctrain launch`` takes horovodrun's launch and elastic flags as horovodrun
does (``-np``, ``-H``, ``--hostfile``, ``--gloo``, ``--start-timeout``,
``--min-np``, ``--max-np``, ``--slots-per-host``, ``--host-discovery-script``,
``--elastic-timeout``, ``--reset-limit``, ``--blacklist-cooldown-range``).
Its other flags set Horovod's tuning or its own remote shell; hpctrain has
its own settings or leaves the choice to mpirun, so each is refused naming
what to use instead, before anything starts.
"""
from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["NOT_TAKEN", "refusal"]

_TUNING = "hpctrain tunes itself (`hpctrain tune`); set {} in the environment instead"
_SHELL = "mpirun starts the remote ranks: give ssh's options in OMPI_MCA_plm_ssh_args instead"
_HIERARCHICAL = _TUNING.format("HPCTRAIN_HIERARCHICAL_MIN_BYTES (bytes)")
_IFACE = ("mpirun picks the network: set OMPI_MCA_btl_tcp_if_include and OMPI_MCA_oob_tcp_if_include "
          "(e.g. eth0) instead")

NOT_TAKEN = {
    "--network-interface": _IFACE, "--network-interfaces": _IFACE,
    "-p": _SHELL, "--ssh-port": _SHELL, "-i": _SHELL, "--ssh-identity-file": _SHELL,
    "--fusion-threshold-mb": _TUNING.format("HPCTRAIN_FUSION_THRESHOLD (bytes)"),
    "--cycle-time-ms": _TUNING.format("HOROVOD_CYCLE_TIME (milliseconds)"),
    "--cache-capacity": "hpctrain.horovod keeps no response cache to size",
    "--hierarchical-allreduce": _HIERARCHICAL,
    "--no-hierarchical-allreduce": _HIERARCHICAL,
    "--hierarchical-allgather": "hpctrain's allgather has one algorithm: nothing to choose",
    "--no-hierarchical-allgather": "hpctrain's allgather has one algorithm: nothing to choose",
    "--torus-allreduce": _HIERARCHICAL,
    "--no-torus-allreduce": _HIERARCHICAL,
    "--autotune": "run `hpctrain tune` once per machine instead (its file is read at init)",
    "--no-autotune": "hpctrain does not autotune while training: leave it out",
    "--timeline-filename": "set HOROVOD_TIMELINE (hpctrain.horovod) or HPCTRAIN_TIMELINE in the environment instead",
    "--stall-check-warning-time-seconds": "set HPCTRAIN_STALL_WARNING_S in the environment instead",
    "--stall-check-shutdown-time-seconds": "set HPCTRAIN_STALL_TIMEOUT_S in the environment instead",
    "--no-stall-check": "set HPCTRAIN_STALL_TIMEOUT_S=0 (never abort) and a large HPCTRAIN_STALL_WARNING_S "
                        "in the environment instead",
    "--output-filename": "mpirun's own --output-filename does it: run mpirun (`hpctrain launch --dry-run` prints "
                         "the command)",
    "--mpi-args": "put the options in OMPI_MCA_* variables, or run the command `hpctrain launch --dry-run` prints",
    "--binding-args": "hpctrain launches with --bind-to none; run the command `--dry-run` prints with yours",
    "--tcp": "set OMPI_MCA_btl=self,tcp (or vader,self,tcp) in the environment instead",
    "--jsrun": "hpctrain launches with mpirun or srun (HPCTRAIN_LAUNCHER)",
    "-cb": "run `hpctrain check` (and `hpctrain info`) instead",
    "--check-build": "run `hpctrain check` (and `hpctrain info`) instead",
    "--config-file": "give the flags on the command line and the settings in the environment",
}


def refusal(extras: Sequence[str]) -> Optional[str]:
    """The line refusing the first of ``extras`` (options argparse did not know) that is horovodrun's, else None."""
    for word in extras:
        flag = word.split("=", 1)[0]
        if flag in NOT_TAKEN:
            return f"horovodrun's {flag} is not taken by hpctrain launch: {NOT_TAKEN[flag]}"
    return None
