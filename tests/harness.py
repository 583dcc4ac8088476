"""Launch programs on N real MPI ranks (or under horovodrun) with a hard timeout; rank_suite.py runs test files."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RANK_COUNTS = (1, 2, 3, 4)
# The collectives' files under tests/ranks, by axis (launched together wherever the collectives are run)
COLLECTIVE_FILES = ["test_collectives.py", "test_point_to_point.py", "test_one_node_paths.py", "test_repeated_calls.py"]


def mpirun_cmd(n: int, *extra: str) -> list:
    """Return the venv's mpirun for ``n`` ranks on this machine (root and oversubscription allowed)."""
    return [str(BIN / "mpirun"), "-n", str(n), "--allow-run-as-root", "--oversubscribe",
            "--bind-to", "none", "--mca", "osc", "^ucx", "--output", "tag", *extra]


def base_env(**extra) -> dict:
    """Return the environment for launched ranks: quiet TF, one thread per rank, fast stall abort."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        # A rank that falls out of step must end the job quickly, not at the outer timeout.
        "HPCTRAIN_STALL_WARNING_S": "20",
        "HPCTRAIN_STALL_TIMEOUT_S": "90",
        # Open MPI busy-polls while it waits unless a node is oversubscribed, and then it calls
        # sched_yield, which on Linux hands the core back at once.  Under Horovod at 2 ranks on 2
        # cores, each rank's background thread spinning in MPI starved its own main thread (the
        # horovod-mpirun suite took 133 s at 2 ranks against 18 s with these two).  Waiting ranks
        # sleep instead; results and what is tested do not change.
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "OMPI_MCA_threads_pthreads_yield_strategy": "nanosleep",
    })
    env.pop("HPCTRAIN_BACKEND", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``, its process group and every descendant (prterun starts ranks in their own sessions)."""
    import psutil
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def run(cmd: list, env: dict, timeout: float, cwd=REPO) -> subprocess.CompletedProcess:
    """Run ``cmd`` (in ``cwd``) in its own process group; on timeout kill it and its descendants, and fail loudly."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def saved_arrays(path) -> dict:
    """The arrays of an ``.npz`` file (ckpt_train.py's parameters), read into memory."""
    import numpy as np

    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_bit_identical(got: dict, want: dict) -> None:
    """The same names, dtypes and bits in two dicts of arrays (e.g. a resumed run's and an uninterrupted one's)."""
    import numpy as np

    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
