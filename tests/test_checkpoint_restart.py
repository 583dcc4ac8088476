"""Crash, kill-during-write, preemption and world-size change, with real processes and real signals.

Each scenario runs tests/programs/ckpt_train.py under mpirun, breaks it for
real (SIGKILL of one rank, SIGKILL half-way through a checkpoint file, SIGUSR2
to one rank), relaunches it, and compares the final parameters with an
uninterrupted run of the same program: bit for bit where the world size is
unchanged (deterministic CPU training), within 1e-5 across world sizes (the
gradient sums run in another order).
"""
import os
import re
import sys

import numpy as np
import pytest

from harness import REPO, assert_bit_identical, base_env, mpirun_cmd, run, saved_arrays

PROGRAM = str(REPO / "tests" / "programs" / "ckpt_train.py")
EXIT_PREEMPTED = 75
_references = {}


def launch(n, ckpt, out, *args, timeout=120):
    cmd = mpirun_cmd(n) + [sys.executable, PROGRAM, "--ckpt", str(ckpt), "--out", str(out), *args]
    return run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=60), timeout)


def start_step(log):
    found = re.findall(r"starting at step (\d+)", log)
    assert found, log[-3000:]
    return int(found[-1])


def reference(n, tmp_path_factory, *args):
    key = (n, args)
    if key not in _references:
        d = tmp_path_factory.mktemp(f"ref{n}")
        res = launch(n, d / "ckpt", d / "ref.npz", *args)
        assert res.returncode == 0, res.stdout[-4000:]
        _references[key] = saved_arrays(d / "ref.npz")
    return _references[key]


# The three ways a job is broken share the rank counts (CONTRIBUTING, "The budget"): SIGKILL at 2 and 4, a kill
# while writing at 1 and 3, SIGUSR2 at 1 and 4.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_sigkill_of_one_rank_ends_the_job_and_the_relaunch_resumes_bit_identical(n, tmp_path, tmp_path_factory):
    ref = reference(n, tmp_path_factory)
    killed = launch(n, tmp_path / "ckpt", tmp_path / "out.npz", "--kill", f"{n - 1}:8")
    assert killed.returncode != 0 and not (tmp_path / "out.npz").exists(), killed.stdout[-3000:]
    resumed = launch(n, tmp_path / "ckpt", tmp_path / "out.npz")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert start_step(resumed.stdout) in (3, 6)      # the last committed checkpoint before the kill
    assert_bit_identical(saved_arrays(tmp_path / "out.npz"), ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 3])
def test_a_kill_while_writing_a_checkpoint_falls_back_to_the_previous_one(n, tmp_path, tmp_path_factory):
    ref = reference(n, tmp_path_factory)
    # Rank 0 writes two files per checkpoint (replicated state, its RNG shard): the third is step 6's.
    killed = launch(n, tmp_path / "ckpt", tmp_path / "out.npz", "--kill-in-write", "3")
    assert killed.returncode != 0, killed.stdout[-3000:]
    left = sorted(os.listdir(tmp_path / "ckpt"))
    assert left == ["step-000000003", "step-000000006.partial"], left
    resumed = launch(n, tmp_path / "ckpt", tmp_path / "out.npz")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert start_step(resumed.stdout) == 3
    assert "step-000000006.partial" not in os.listdir(tmp_path / "ckpt")
    assert_bit_identical(saved_arrays(tmp_path / "out.npz"), ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [1, 4])
def test_sigusr2_on_one_rank_checkpoints_every_rank_at_one_step_and_exits(n, tmp_path, tmp_path_factory):
    ref = reference(n, tmp_path_factory)
    stopped = launch(n, tmp_path / "ckpt", tmp_path / "out.npz", "--signal", f"{n - 1}:5")
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stdout[-4000:]
    assert "preempted" in stopped.stdout and "checkpoint of step 5 committed" in stopped.stdout
    assert "step-000000005" in os.listdir(tmp_path / "ckpt")
    assert not (tmp_path / "out.npz").exists()
    resumed = launch(n, tmp_path / "ckpt", tmp_path / "out.npz")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert start_step(resumed.stdout) == 5
    assert_bit_identical(saved_arrays(tmp_path / "out.npz"), ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("written, restored", [(4, 2), (1, 3)])     # fewer ranks and more, every count once
def test_restore_on_another_world_size(written, restored, tmp_path, tmp_path_factory):
    args = ("--dropout", "0")     # per-rank dropout streams cannot carry over to another world size
    ref = reference(written, tmp_path_factory, *args)
    first = launch(written, tmp_path / "ckpt", tmp_path / "at6.npz", "--stop-after", "6", *args)
    assert first.returncode == 0, first.stdout[-4000:]
    # Restoring alone (no steps left) gives back exactly what was written.
    again = launch(restored, tmp_path / "ckpt", tmp_path / "restored6.npz", "--steps", "6", *args)
    assert again.returncode == 0 and start_step(again.stdout) == 6, again.stdout[-4000:]
    assert_bit_identical(saved_arrays(tmp_path / "restored6.npz"), saved_arrays(tmp_path / "at6.npz"))
    # Training on from there on the new world size sees the same global batches.
    resumed = launch(restored, tmp_path / "ckpt", tmp_path / "out.npz", *args)
    assert resumed.returncode == 0 and start_step(resumed.stdout) == 6, resumed.stdout[-4000:]
    got = saved_arrays(tmp_path / "out.npz")
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_a_per_epoch_keras_save_is_committed_so_a_kill_in_the_next_epoch_resumes_there(tmp_path):
    # The README's Keras quickstart saves once an epoch.  Before, that save was committed only by the next
    # save(), a whole epoch later: a kill in epoch 2 resumed at epoch 1.
    program = [sys.executable, str(REPO / "tests" / "programs" / "keras_epochs.py"), str(tmp_path / "ckpt")]
    killed = run(mpirun_cmd(2) + program + ["2"], base_env(), 180)
    assert killed.returncode != 0 and "killed in epoch 2; committed: step 2" in killed.stdout, killed.stdout[-3000:]
    again = run(mpirun_cmd(2) + program, base_env(), 180)
    assert again.returncode == 0, again.stdout[-3000:]
    trained = re.findall(r"training epoch (\d)", again.stdout)
    assert "hpctrain: resumed from step 2 (" in again.stdout and trained == ["2", "3"], again.stdout[-3000:]


@pytest.mark.timeout(300)
def test_ctrl_c_to_hpctrain_launch_saves_every_rank_exits_75_and_the_rerun_resumes_bit_identical(tmp_path,
                                                                                                tmp_path_factory):
    """SIGINT to the launcher's process group (a terminal's Ctrl-C) reaches the ranks as their preemption signal:
    on_preemption saves and says so, the job exits 75, and the same command resumes to the reference's bits."""
    import signal
    import subprocess
    import time

    from harness import BIN, kill_tree

    ref = reference(2, tmp_path_factory)
    cmd = [str(BIN / "hpctrain"), "launch", "-n", "2", sys.executable, PROGRAM, "--ckpt", str(tmp_path / "ckpt"),
           "--out", str(tmp_path / "out.npz")]
    proc = subprocess.Popen(cmd + ["--step-sleep", "0.3"], cwd=REPO, env=base_env(HPCTRAIN_STALL_TIMEOUT_S=60),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == "step 2":
                break
        os.killpg(proc.pid, signal.SIGINT)
        start = time.monotonic()
        rest, _ = proc.communicate(timeout=60)
        log = "".join(seen) + rest
        assert proc.returncode == EXIT_PREEMPTED, log[-4000:]
        assert time.monotonic() - start < 30
        assert "SIGINT passed to the ranks as SIGUSR2" in log and "preempted (SIGUSR2); checkpoint of step" in log
    finally:
        kill_tree(proc)
    saved = int(re.search(r"checkpoint of step (\d+) committed", log).group(1))
    assert 2 <= saved < 12 and not (tmp_path / "out.npz").exists()
    resumed = run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=60), 120)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert start_step(resumed.stdout) == saved
    assert_bit_identical(saved_arrays(tmp_path / "out.npz"), ref)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_file_system_error_at_a_checkpoint_is_one_line_per_job_and_leaves_what_was_committed(fault, tmp_path):
    """A checkpoint directory on a read-only file system, or on one that fills up after the first checkpoint
    (a 64 KiB tmpfs): one line for the whole job naming the directory, the errno and what to do; no traceback;
    the checkpoint committed before the fault stays whole."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting the small file systems needs root (CI and the development machines run as root)")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    opts = "size=64k" + (",ro" if fault == "read-only" else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mnt)], check=True)
    try:
        res = launch(2, mnt / "ckpt", tmp_path / "out.npz")
        assert res.returncode != 0
        lines = [line for line in res.stdout.splitlines() if "hpctrain: error:" in line]
        assert len(lines) == 1 and "Traceback" not in res.stdout, res.stdout[-4000:]
        if fault == "read-only":
            assert f"cannot use checkpoint directory {mnt / 'ckpt'}: EROFS" in lines[0]
            assert "give a checkpoint directory on a writable one" in lines[0]
        else:
            assert f"in {mnt / 'ckpt'} failed; nothing was committed" in lines[0] and "ENOSPC" in lines[0]
            assert "free space there, or keep fewer checkpoints" in lines[0]
            committed = sorted(os.listdir(mnt / "ckpt"))
            assert committed == ["step-000000003"], committed
            resumed = launch(2, mnt / "ckpt", tmp_path / "out.npz", "--stop-after", "3")    # (it loads, verified)
            assert start_step(resumed.stdout) == 3, resumed.stdout[-3000:]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
