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


def memory_mb() -> int:
    """This machine's memory as slurmd measures it (RealMemory)."""
    mem = re.search(r"RealMemory=(\d+)", _run(["/usr/sbin/slurmd", "-C"]).stdout)
    return int(mem.group(1)) if mem else 1000


class LocalSlurm:
    """One controller and one node on 127.0.0.1; ``env`` is what clients (sbatch, squeue) need."""

    def __init__(self, scratch: Path):
        self.dir = Path(scratch)
        self.conf = self.dir / "slurm.conf"
        self.env: Dict[str, str] = dict(os.environ, SLURM_CONF=str(self.conf))
        self._started_munge = False
        self.node = socket.gethostname().split(".")[0]
        self.client: List[str] = []      # what runs the client commands (sbatch, squeue...): here, directly

    # -- lifecycle --------------------------------------------------------------
    def start(self) -> "LocalSlurm":
        ensure_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local Slurm runs its daemons as root; this test run is not root")
        _pmix_symlink()
        self._start_munge()
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join(self._conf_lines()) + "\n")
        for where, daemon in self._daemons():
            res = _run([*where, f"/usr/sbin/{daemon}", "-f", str(self.conf)], env=self.env)
            if res.returncode != 0:
                self.stop()
                raise SlurmUnavailable(f"{daemon} did not start: {res.stdout}{res.stderr}\n{self.daemon_logs()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.node_state()
            if self.idle():
                return self
            time.sleep(0.5)
        self.stop()
        raise SlurmUnavailable(f"the nodes never became idle (sinfo says {state!r})\n{self.daemon_logs()}")

    def _daemons(self):
        """(command prefix, daemon) for each daemon to start, in order: here, the controller and one node."""
        return [([], "slurmctld"), ([], "slurmd")]

    def stop(self) -> None:
        """Stop the daemons by the pids in their pid files (never by name)."""
        for path in sorted(self.dir.glob("slurmd*.pid")) + [self.dir / "slurmctld.pid"]:
            self._kill_pidfile(path)
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

    def _conf_lines(self) -> List[str]:
        """slurm.conf: the settings every local cluster shares, then :meth:`_conf_nodes`."""
        d = self.dir
        return [
            # A step's credential lives cred_expire seconds (also the requeue delay, which
            # release_after_requeue shortens): 10 s failed a step launch on a loaded 2-core machine.
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "AuthInfo=cred_expire=30",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "MailProg=/bin/true", "ReturnToService=2",
            "SchedulerParameters=sched_interval=2,bf_interval=2", "MinJobAge=300", "KillWait=10",
            f"StateSaveLocation={d / 'state'}", f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
        ] + self._conf_nodes()

    def _conf_nodes(self) -> List[str]:
        """Controller, node and partition lines: one node, this host, on 127.0.0.1 with free ports."""
        d = self.dir
        return [
            "ClusterName=hpctrain-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            f"SlurmdSpoolDir={d / 'spool'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} RealMemory={memory_mb()} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]

    def daemon_logs(self) -> str:
        """The last 2,000 characters of each daemon's log (for a failure's message)."""
        out = []
        for log in sorted((self.dir / "log").glob("*.log")):
            out.append(f"--- {log.name} ---\n" + log.read_text(errors="replace")[-2000:])
        return "\n".join(out)

    # -- jobs -------------------------------------------------------------------------
    def submit(self, args: List[str], cwd: Path, env: Optional[Dict[str, str]] = None) -> str:
        """``sbatch --parsable args``; return the job id."""
        res = _run([*self.client, "sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})})
        if res.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} failed: {res.stderr}")
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = _run([*self.client, "scontrol", "show", "job", "-o", job_id], env=self.env).stdout
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
        self.scancel(job_id)
        raise AssertionError(f"job {job_id} did not finish in {timeout} s: {info}\n{self.daemon_logs()}")

    @staticmethod
    def wait_for_line(path: Path, pattern: str, timeout: float) -> None:
        """Poll a job's output file until a line matches ``pattern`` (raise, with the file, on timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and re.search(pattern, path.read_text(errors="replace"), re.M):
                return
            time.sleep(0.25)
        raise AssertionError(f"{pattern!r} never appeared in {path}:\n"
                             + (path.read_text(errors="replace")[-3000:] if path.exists() else "(no file)"))

    def node_state(self) -> str:
        """The nodes' states as ``sinfo`` prints them, one a line: idle, mixed, allocated, completing, ..."""
        return _run([*self.client, "sinfo", "-h", "-N", "-o", "%T"], env=self.env).stdout.strip()

    def idle(self) -> bool:
        """Every node idle (no job, nothing still ending)."""
        state = self.node_state()
        return bool(state) and set(state.split()) == {"idle"}

    def release_after_requeue(self, job_id: str, timeout: float = 120) -> None:
        """Once a requeued job is pending again, let it start soon instead of after the requeue delay.

        The job shows PENDING while its first run may still be ending on the
        nodes: it is released only when they are idle, else the first run's
        batch step can finish after the rerun started and its exit status is
        taken for the rerun's.  And not within the same second: slurmd revokes
        the killed run's credential with a time stamp in whole seconds and
        refuses a launch whose credential is not newer ("Job credential
        revoked").  The requeue delay prevents both on a real cluster.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("Restarts", "0") != "0" and info.get("JobState") == "PENDING" and self.idle():
                self.scontrol("update", f"JobId={job_id}", "StartTime=now+2")
                return
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"):
                return
            time.sleep(0.25)

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return _run([*self.client, "scontrol", *args], env=self.env)

    def scancel(self, *args: str) -> subprocess.CompletedProcess:
        return _run([*self.client, "scancel", *args], env=self.env)
