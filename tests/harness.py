"""Launch test programs on N real MPI ranks (or under horovodrun) with a hard timeout."""
from __future__ import annotations

import os
import re
import signal
import tempfile
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
RANK_COUNTS = (1, 2, 3, 4)


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
    })
    env.pop("HPCTRAIN_BACKEND", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd: list, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; on timeout kill the whole group and fail loudly."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _clean_pass(log: str) -> bool:
    """Return True when a rank's pytest log ends with a summary of passes and no failure or error."""
    lines = [line for line in log.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    return bool(re.search(r"\d+ passed", last)) and not re.search(r"failed|error", last)


def run_pytest_on_ranks(n: int, test_file: str, timeout: float = 900, launcher=None, select: str = "",
                        **env) -> str:
    """Run one test file under ``n`` ranks (all its tests inside one launch) and assert it passed everywhere.

    Each rank writes its pytest output to its own log; on failure the logs of
    the ranks that did not pass are shown.  Returns rank 0's log.
    """
    with tempfile.TemporaryDirectory(prefix="hpctrain-ranks-") as logdir:
        inner = [sys.executable, str(REPO / "tests" / "rank_main.py"), logdir,
                 "-q", "-p", "no:cacheprovider", "--timeout=240", "--color=no", "--durations=5",
                 str(REPO / "tests" / "ranks" / test_file)] + (["-k", select] if select else [])
        cmd = (launcher or mpirun_cmd)(n) + inner
        result = run(cmd, base_env(HPCTRAIN_INNER_PYTEST=1, **env), timeout)
        logs = {}
        for r in range(n):
            path = Path(logdir) / f"rank{r}.log"
            logs[r] = path.read_text(errors="replace") if path.exists() else "(no log: the rank never started)"
    bad = [r for r in range(n) if not _clean_pass(logs[r])]
    shown = "\n".join(f"----- rank {r} -----\n{logs[r][-8000:]}" for r in (bad or [0])[:2])
    assert result.returncode == 0 and not bad, (
        f"{' '.join(cmd)}\nexit status {result.returncode}; ranks without a clean pass: {bad}\n"
        f"{shown}\n----- launcher -----\n{result.stdout[-3000:]}")
    return logs[0]
