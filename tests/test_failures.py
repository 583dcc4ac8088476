"""A dying, raising or stalled rank ends the whole job quickly instead of hanging it (1-4 real ranks)."""
import sys
import time

import pytest

from harness import RANK_COUNTS, REPO, base_env, mpirun_cmd, run

PROGRAMS = REPO / "tests" / "programs"


def launch(n, program, *args, timeout=90, **env):
    start = time.monotonic()
    result = run(mpirun_cmd(n) + [sys.executable, *program, *map(str, args)], base_env(**env), timeout)
    return result, time.monotonic() - start


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_sigkilled_rank_ends_the_job_within_30s(n):
    # The victim kills itself with SIGKILL mid-training; the others sit in allreduce.
    result, took = launch(n, [str(PROGRAMS / "die.py")], "sigkill", n - 1,
                          HPCTRAIN_STALL_TIMEOUT_S=600)
    assert result.returncode != 0, result.stdout[-3000:]
    assert took < 30, f"the job took {took:.1f} s to end"
    assert "steps done" in result.stdout  # training was really running before the kill


@pytest.mark.parametrize("n", RANK_COUNTS)
@pytest.mark.parametrize("how", ["excepthook", "hpctrain.run"])
def test_uncaught_exception_aborts_every_rank(n, how):
    program = [str(PROGRAMS / "die.py")] if how == "excepthook" else ["-m", "hpctrain.run", str(PROGRAMS / "die.py")]
    result, took = launch(n, program, "raise", n - 1, HPCTRAIN_STALL_TIMEOUT_S=600)
    assert result.returncode != 0
    assert took < 30, f"the job took {took:.1f} s to end"
    assert "uncaught exception" in result.stdout and "RuntimeError: boom on rank" in result.stdout


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_stall_watchdog_names_missing_rank_and_aborts(n):
    result, took = launch(n, [str(PROGRAMS / "die.py")], "stall", n - 1,
                          HPCTRAIN_STALL_WARNING_S=1, HPCTRAIN_STALL_TIMEOUT_S=4)
    assert result.returncode != 0
    assert took < 40
    out = result.stdout
    assert "has not finished after" in out and "stalled for" in out and "aborting the job" in out, out[-3000:]
    if n > 1:  # rank 0 knows who never made the call
        assert f"not yet joined by rank {n - 1} of world (world rank {n - 1})" in out, out[-3000:]
