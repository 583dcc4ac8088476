"""A real one-node Slurm (slurmctld + slurmd + munge) on this machine, for the sbatch script tests.

Installs Debian's packages when they are missing (root and apt needed),
writes a slurm.conf under a scratch directory (free ports, no cgroups, no
accounting, fast requeue), starts the daemons, and stops them by their pid
files.  What worked and why is in ``../shared/slurm-local.md``.  Anything that
cannot be done raises :class:`SlurmUnavailable` with what is missing: the
tests then fail with that message; they never skip.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "libpmix2"]
NODE_CPUS = 4          # declared (config_overrides) so that jobs of 1-4 tasks fit on a 2-core machine


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says what is missing."""


def _run(cmd, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_installed() -> None:
    """Install the Debian packages unless slurmctld, slurmd, sbatch and munged are all there."""
    needed = ["slurmctld", "slurmd", "sbatch", "munged"]
    if all(shutil.which(b) or os.path.exists(f"/usr/sbin/{b}") for b in needed):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(f"Slurm is not installed ({', '.join(needed)}) and cannot be installed here: "
                               f"needs root and apt-get (packages: {' '.join(PACKAGES)})")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        res = _run(cmd, timeout=900, env=env)
        if res.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")


def _pmix_symlink() -> None:
    """srun's pmix plugin dlopens <libdir>/pmix2/lib/libpmix.so, which only libpmix-dev provides."""
    for so2 in glob.glob("/usr/lib/*/pmix2/lib/libpmix.so.2"):
        link = os.path.join(os.path.dirname(so2), "libpmix.so")
        if not os.path.exists(link):
            os.symlink("libpmix.so.2", link)


class LocalSlurm:
    """One controller and one node on 127.0.0.1; ``env`` is what clients (sbatch, squeue) need."""

    def __init__(self, scratch: Path):
        self.dir = Path(scratch)
        self.conf = self.dir / "slurm.conf"
        self.env: Dict[str, str] = dict(os.environ, SLURM_CONF=str(self.conf))
        self._started_munge = False
        self.node = socket.gethostname().split(".")[0]

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> "LocalSlurm":
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local Slurm runs its daemons as root; this test run is not root")
        _pmix_symlink()
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            res = _run([f"/usr/sbin/{daemon}", "-f", str(self.conf)], env=self.env)
            if res.returncode != 0:
                self.stop()
                raise SlurmUnavailable(f"{daemon} did not start: {res.stdout}{res.stderr}\n{self._logs()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.node_state()
            if state == "idle":
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"the node never became idle (sinfo says {state!r})\n{self._logs()}")

    def stop(self) -> None:
        """Stop the daemons by the pids in their pid files (never by name)."""
        for name in ("slurmd.pid", "slurmctld.pid"):
            self._kill_pidfile(self.dir / name)
        if self._started_munge:
            self._kill_pidfile(Path("/run/munge/munged.pid"))

    @staticmethod
    def _kill_pidfile(path: Path) -> None:
        try:
            pid = int(path.read_text().strip())
        except (OSError, ValueError):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.kill(pid, signal.SIGKILL)

    def _start_munge(self) -> None:
        if _run(["bash", "-c", "munge -n | unmunge"]).returncode == 0:
            return                                    # already running
        if not os.path.exists("/etc/munge/munge.key"):
            res = _run(["mungekey", "--create", "--force"])
            if res.returncode != 0:
                raise SlurmUnavailable(f"mungekey failed: {res.stderr}")
            shutil.chown("/etc/munge/munge.key", "munge", "munge")
            os.chmod("/etc/munge/munge.key", 0o400)
        _run(["install", "-d", "-o", "munge", "-g", "munge", "/run/munge"])
        res = _run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
        if res.returncode != 0 or _run(["bash", "-c", "munge -n | unmunge"]).returncode != 0:
            raise SlurmUnavailable(f"munged did not start: {res.stderr}")
        self._started_munge = True

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        probe = _run(["/usr/sbin/slurmd", "-C"]).stdout
        mem = re.search(r"RealMemory=(\d+)", probe)
        d = self.dir
        self.conf.write_text("\n".join([
            "ClusterName=hpctrain-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "AuthInfo=cred_expire=10",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "MailProg=/bin/true", "ReturnToService=2",
            "SchedulerParameters=sched_interval=2,bf_interval=2", "MinJobAge=300", "KillWait=10",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} "
            f"RealMemory={int(mem.group(1)) if mem else 1000} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]) + "\n")

    def _logs(self) -> str:
        out = []
        for log in sorted((self.dir / "log").glob("*.log")):
            out.append(f"--- {log.name} ---\n" + log.read_text(errors="replace")[-2000:])
        return "\n".join(out)

    # -- jobs -------------------------------------------------------------------------
    def submit(self, args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> str:
        """``sbatch --parsable args``; return the job id."""
        res = _run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})})
        if res.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed: {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = _run(["scontrol", "show", "job", "-o", job_id], env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, timeout: float, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                        "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> Dict[str, str]:
        """Poll until the job reaches one of ``states``; return its record (raise on timeout)."""
        deadline = time.monotonic() + timeout
        info: Dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        _run(["scancel", job_id], env=self.env)
        raise AssertionError(f"job {job_id} did not finish in {timeout} s: {info}\n{self._logs()}")

    def node_state(self) -> str:
        """The node's state as ``sinfo`` prints it: idle, mixed, allocated, completing, ..."""
        return _run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env).stdout.strip()

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return _run(["scontrol", *args], env=self.env)

    def scancel(self, *args: str) -> subprocess.CompletedProcess:
        return _run(["scancel", *args], env=self.env)
