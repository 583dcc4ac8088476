"""A dying, raising, stalled or departed rank ends the whole job quickly instead of hanging it (1-4 real ranks)."""
import re
import sys
import time

import pytest

from harness import BIN, RANK_COUNTS, REPO, base_env, mpirun_cmd, run

PROGRAMS = REPO / "tests" / "programs"


def launch(n, program, *args, timeout=90, **env):
    start = time.monotonic()
    result = run(mpirun_cmd(n) + [sys.executable, *program, *map(str, args)], base_env(**env), timeout)
    return result, time.monotonic() - start


def after_leaving(result) -> float:
    """Seconds from the moment die.py's leaver left to the end of the job."""
    left = re.search(r"leaves early at (\d+\.\d+)", result.stdout)
    assert left, result.stdout[-3000:]
    return time.time() - float(left.group(1))


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_sigkilled_rank_ends_the_job_within_30s(n):
    # The victim kills itself with SIGKILL mid-training; the others sit in allreduce.
    result, took = launch(n, [str(PROGRAMS / "die.py")], "sigkill", n - 1,
                          HPCTRAIN_STALL_TIMEOUT_S=600)
    assert result.returncode != 0, result.stdout[-3000:]
    assert took < 30, f"the job took {took:.1f} s to end"
    assert "steps done" in result.stdout  # training was really running before the kill


# The two ways an exception reaches hpctrain (the exception hook, python -m hpctrain.run) share the rank counts.
@pytest.mark.parametrize("n, how", [(1, "excepthook"), (2, "hpctrain.run"), (3, "excepthook"), (4, "hpctrain.run")])
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


LEAVERS = [(n, leaver, ("return", "exit", "shutdown")[(n + i) % 3])
           for n in (2, 3, 4) for i, leaver in enumerate(("first", "last"))]


@pytest.mark.parametrize("n, leaver, how", LEAVERS)
def test_a_rank_that_leaves_early_ends_the_job_within_10s_naming_it(n, leaver, how):
    victim = 0 if leaver == "first" else n - 1
    result, _ = launch(n, [str(PROGRAMS / "die.py")], how, victim, HPCTRAIN_STALL_TIMEOUT_S=600)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "steps done" in result.stdout
    assert after_leaving(result) < 10, f"the job ended {after_leaving(result):.1f} s after the rank left"
    message = (f"world rank {victim} left the job (returned, exited or called hpctrain.shutdown()) while this "
               f"rank waits for it in allreduce(float64[1000]")
    waiting = [r for r in range(n) if r != victim]
    assert any(f"hpctrain: rank {r}: {message}" in result.stdout for r in waiting), result.stdout[-3000:]


def horovodrun(n):
    return [str(BIN / "horovodrun"), "--gloo", "--gloo-timeout-seconds", "300", "-np", str(n), "-H", f"localhost:{n}"]


# On the Horovod backend, each rank count once (the ways of leaving and which rank leaves still vary).
@pytest.mark.parametrize("launcher, n, leaver, how", [("mpirun", *LEAVERS[i]) for i in (0, 3, 4)]
                         + [("horovodrun", 2, "last", "exit"), ("horovodrun", 3, "first", "return")])
def test_on_horovod_a_rank_that_leaves_early_ends_the_job_naming_it(launcher, n, leaver, how):
    victim = 0 if leaver == "first" else n - 1
    cmd = (mpirun_cmd(n) if launcher == "mpirun" else horovodrun(n)) + [
        sys.executable, str(PROGRAMS / "die.py"), how, str(victim)]
    result = run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=600, HPCTRAIN_BACKEND="horovod"), 120)
    assert result.returncode != 0, result.stdout[-3000:]
    assert after_leaving(result) < 10, f"the job ended {after_leaving(result):.1f} s after the rank left"
    assert f"world rank {victim} left the job (returned, exited or called hpctrain.shutdown()) while this rank " \
           f"waits for it in allreduce(float64[1000]" in result.stdout, result.stdout[-3000:]


@pytest.mark.parametrize("n", RANK_COUNTS)
def test_ranks_that_finish_together_leave_cleanly(n):
    result, _ = launch(n, [str(PROGRAMS / "die.py")], "return", -1, HPCTRAIN_STALL_WARNING_S=2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "steps done" in result.stdout and "left the job" not in result.stdout
    assert "waits for" not in result.stdout, result.stdout[-3000:]      # nobody waited 2 s for the others


# -- the way out: nothing at exit hangs, every failure there is named on its rank, the rank's status is the job's --

@pytest.mark.parametrize("n, how", [(2, "explicit"), (3, "atexit"), (4, "explicit")])     # (the two share counts)
def test_every_failure_at_shutdown_is_named_on_its_rank_and_ends_the_job_in_seconds(n, how, tmp_path):
    # The timeline, metrics, checkpoint commit and communication-log table all fail at shutdown, and a user's
    # atexit hook raises: before, the first failure (in an exit hook) skipped rank 0's leaving notice and the
    # others waited for it for ever.
    trace, metrics, ckpt = tmp_path / "timeline" / "trace.json", tmp_path / "metrics", tmp_path / "ckpt"
    trace.parent.mkdir()
    result, took = launch(n, [str(PROGRAMS / "exit_paths.py")], tmp_path, "failures", how, timeout=60,
                          HPCTRAIN_TIMELINE=trace, HPCTRAIN_COMM_LOG=1, HPCTRAIN_STALL_TIMEOUT_S=20)
    out = result.stdout
    assert "steps done" in out, out[-3000:]
    assert result.returncode != 0 and took < 20, (result.returncode, took, out[-3000:])
    assert f"hpctrain: rank 0: the timeline writer ({trace}) failed at shutdown: FileExistsError" in out, out[-3000:]
    assert f"hpctrain: rank 0: the step metrics ({metrics}) failed at shutdown: NotADirectoryError" in out
    assert "hpctrain: rank 0: the communication log's table failed at shutdown: ValueError" in out
    for r in range(n):       # the commit's failure is raised on every rank
        assert (f"hpctrain: rank {r}: the checkpoint manager of {ckpt} failed at shutdown: CheckpointError: "
                f"committing the checkpoint of step 1 failed") in out, out[-3000:]
    assert f"boom in an atexit hook of rank {n - 1}" in out
    assert not (ckpt / "step-000000001").is_dir() and not list(ckpt.glob("*.partial"))   # nothing half-made stays


@pytest.mark.parametrize("n", (2, 4))
def test_ranks_that_finished_wait_for_a_straggler_only_until_the_stall_timeout(n, tmp_path):
    result, took = launch(n, [str(PROGRAMS / "exit_paths.py")], tmp_path, "straggler", timeout=60,
                          HPCTRAIN_STALL_TIMEOUT_S=3, HPCTRAIN_STALL_WARNING_S=1)
    assert "steps done" in result.stdout and result.returncode != 0, result.stdout[-3000:]
    assert took < 20, f"the job took {took:.1f} s to end"
    assert re.search(rf"hpctrain: rank \d+ has finished and waited 3 s \(HPCTRAIN_STALL_TIMEOUT_S\) for world rank "
                     rf"{n - 1} to finish too; aborting the job", result.stdout), result.stdout[-3000:]


@pytest.mark.parametrize("n", (2, 3))
def test_a_rank_that_exits_with_a_status_ends_the_job_with_that_status_naming_it(n):
    result, _ = launch(n, [str(PROGRAMS / "die.py")], "exit3", n - 1, HPCTRAIN_STALL_TIMEOUT_S=600)
    assert result.returncode == 3, (result.returncode, result.stdout[-3000:])
    assert after_leaving(result) < 10
    assert (f"world rank {n - 1} exited with status 3 while this rank waits for it in allreduce(float64[1000]"
            in result.stdout), result.stdout[-3000:]


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_under_the_horovod_api_a_rank_that_exits_early_is_named_with_its_status(launcher):
    cmd = (mpirun_cmd(2) if launcher == "mpirun" else horovodrun(2)) + [
        sys.executable, str(PROGRAMS / "hvd_leaver.py"), "3"]
    result = run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=600), 120)
    assert "steps done" in result.stdout, result.stdout[-3000:]
    assert after_leaving(result) < 10
    assert "Horovod has been shut down: rank 1 left the job (exited with status 3)" in result.stdout, \
        result.stdout[-3000:]
    assert result.returncode == (3 if launcher == "mpirun" else 1)     # (horovodrun exits 1 whatever failed)


# (the three launches share the counts 2-4; a world of one has nobody to disagree with)
@pytest.mark.parametrize("launch, n", [("hpctrain launch", 2), ("hpctrain launch --elastic", 3), ("mpirun", 4)])
def test_a_call_the_ranks_disagree_on_ends_the_job_with_one_message_naming_each_ranks_call(launch, n):
    """The last rank all-reduces 1001 values where the others all-reduce 1000, uncaught: the call check's error is
    raised alike on every rank, so it is one message on rank 0 (each rank's call on a line of its own), no
    traceback, and every rank leaves at once with status 1, in elastic mode too (not a failed rank each)."""
    die = [sys.executable, str(PROGRAMS / "die.py"), "mismatch", str(n - 1)]
    cmd = (mpirun_cmd(n) + die if launch == "mpirun"
           else [str(BIN / "hpctrain"), *launch.split()[1:], "-n", str(n), *die])
    start = time.monotonic()
    result = run(cmd, base_env(), 90)
    took = time.monotonic() - start
    out = result.stdout
    assert result.returncode == 1 and "steps done" in out and took < 30, out[-3000:]
    assert "Traceback" not in out and "leaves the job as a failed rank" not in out, out[-3000:]
    assert out.count("hpctrain: error: ranks of world disagree on collective call #21") == 1, out[-3000:]
    others = "rank 0" if n == 2 else f"ranks 0-{n - 2}"
    for who, size in ((others, 1000), (f"rank {n - 1}", 1001)):     # (mpirun_cmd tags each line with its rank)
        assert re.search(rf"^(\[1,0\]<stderr>: )?  {who}: allreduce\(float64\[{size}\]", out, re.M), out[-3000:]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ranks_whose_algorithm_settings_differ_stop_at_init_with_one_line_naming_each_setting_and_rank(n):
    """Settings that decide which collective runs must be alike on every rank (else a hang, or one rank's
    measured choice read as another's data): HPCTRAIN_SHM_MIN_BYTES set on rank 0 only and HPCTRAIN_CHECK=0
    on the last rank end the job at init(), every setting named with the ranks that hold each value."""
    die = [sys.executable, str(PROGRAMS / "die.py"), "return", "-1"]
    cmd = (mpirun_cmd(1) + ["env", "HPCTRAIN_SHM_MIN_BYTES=1MiB", *die]
           + ([":", "-n", str(n - 2), *die] if n > 2 else []) + [":", "-n", "1", "env", "HPCTRAIN_CHECK=0", *die])
    start = time.monotonic()
    result = run(cmd, base_env(), 90)
    took = time.monotonic() - start
    lines = [line for line in result.stdout.splitlines() if "hpctrain" in line or "Traceback" in line]
    assert result.returncode != 0 and "steps done" not in result.stdout and took < 30, result.stdout[-3000:]
    assert len(lines) == 1 and "hpctrain: error: ranks of world disagree on settings" in lines[0], result.stdout
    others = "rank 1" if n == 2 else f"ranks 1-{n - 1}"
    firsts = "rank 0" if n == 2 else f"ranks 0-{n - 2}"
    assert f"HPCTRAIN_SHM_MIN_BYTES (rank 0: 1048576; {others}: 0)" in lines[0], lines[0]
    assert f"HPCTRAIN_CHECK ({firsts}: True; rank {n - 1}: False)" in lines[0], lines[0]


@pytest.mark.parametrize("variable, value, said", [
    ("HPCTRAIN_STALL_TIMEOUT_S", "soon", "HPCTRAIN_STALL_TIMEOUT_S='soon': expected seconds, at least 0"),
    ("HPCTRAIN_TIMELINE", "/proc/no-such-folder/trace.json", "HPCTRAIN_TIMELINE='/proc/no-such-folder/trace.json': "
     "on rank 0, cannot create a file there (FileNotFoundError"),
])
def test_a_bad_setting_is_one_line_for_the_whole_job_and_no_rank_starts_training(variable, value, said):
    result, took = launch(3, [str(PROGRAMS / "die.py")], "return", -1, **{variable: value})
    lines = [line for line in result.stdout.splitlines() if "hpctrain" in line or "Traceback" in line]
    assert result.returncode != 0 and "steps done" not in result.stdout
    assert len(lines) == 1 and f"<stderr>: hpctrain: error: {said}" in lines[0], result.stdout[-3000:]
