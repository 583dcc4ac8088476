"""The sbatch scripts against a real slurmctld + slurmd on this machine (see tests/slurm_cluster.py).

If Slurm cannot be installed or started here these tests fail with the
reason; they do not skip.
"""
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from harness import RANK_COUNTS, REPO, assert_bit_identical, base_env, mpirun_cmd, run, saved_arrays
from slurm_cluster import LocalSlurm, SlurmUnavailable

VENV = Path(sys.executable).parent.parent
CKPT_TRAIN = str(REPO / "tests" / "programs" / "ckpt_train.py")
DIGITS = ["python", str(REPO / "examples" / "torch_digits.py"), "--epochs", "4", "--min-accuracy", "0.9"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    try:
        cluster = LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    except SlurmUnavailable as exc:
        pytest.fail(f"the Slurm tests need a local Slurm controller and node: {exc}", pytrace=False)
    yield cluster
    cluster.stop()


def job_env(**extra):
    return base_env(**{"HPCTRAIN_HOME": str(REPO), "HPCTRAIN_VENV": str(VENV), **extra})


def sbatch(slurm, tmp_path, n, script, args, timeout=300, **env):
    """Submit ``slurm/<script>`` with ``n`` tasks, wait for it; return (record, log text)."""
    log = tmp_path / "job.log"
    job = slurm.submit([f"--ntasks={n}", f"--output={log}", str(REPO / "slurm" / script), *args], cwd=REPO,
                       env=job_env(**env))
    info = slurm.wait(job, timeout)
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    if info.get("JobState") != "COMPLETED":      # what the daemons said goes with the job's own log
        text += "\n" + slurm.daemon_logs()
    return info, text


def summary_of(path):
    import json
    return json.loads(Path(path).read_text())


@pytest.mark.timeout(400)
# The two sbatch scripts share the rank counts: train.sbatch at 1 and 3, horovod.sbatch at 2 and 4.
@pytest.mark.parametrize("n", [1, 3])
def test_train_sbatch_trains_the_digits_example(slurm, tmp_path, n):
    out = tmp_path / "summary.json"
    info, log = sbatch(slurm, tmp_path, n, "train.sbatch", DIGITS + ["--out", str(out)])
    assert info["JobState"] == "COMPLETED", log[-8000:]
    assert "launcher srun" in log
    s = summary_of(out)
    assert s["ranks"] == n and s["replicas_identical"] and s["test_accuracy"] >= 0.9


@pytest.mark.timeout(400)
# (the digits example: srun at 1 and 3 above, these two at 2 and 3, plain mpirun at 4 in test_examples.py)
@pytest.mark.parametrize("how, n", [("hpctrain launch", 2), ("mpirun", 3)])
def test_the_other_launch_paths_inside_an_allocation(slurm, tmp_path, n, how):
    out = tmp_path / "summary.json"
    if how == "mpirun":
        info, log = sbatch(slurm, tmp_path, n, "train.sbatch", DIGITS + ["--out", str(out)],
                           HPCTRAIN_LAUNCHER="mpirun")
        assert "launcher mpirun" in log
    else:
        log_path = tmp_path / "job.log"
        cmd = " ".join([str(VENV / "bin" / "hpctrain"), "launch", "-n", str(n), *DIGITS, "--out", str(out)])
        job = slurm.submit([f"--ntasks={n}", f"--output={log_path}", "--wrap", cmd], cwd=REPO, env=job_env())
        info = slurm.wait(job, 300)
        log = log_path.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", log[-8000:]
    assert summary_of(out)["ranks"] == n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_launch_where_every_task_is_a_world_of_one_is_refused(slurm, tmp_path, n):
    # srun --mpi=pmi2 with Open MPI 5 starts N singletons that would each train alone.
    info, log = sbatch(slurm, tmp_path, n, "train.sbatch", DIGITS, HPCTRAIN_LAUNCHER="srun",
                       HPCTRAIN_SRUN_MPI="pmi2")
    assert info["JobState"] == "FAILED", log[-4000:]
    assert f"started {n} tasks but MPI sees a world of size 1" in log, log[-4000:]


_references = {}


def reference(n, tmp_path_factory):
    """The uninterrupted run's parameters at ``n`` ranks (one run per rank count, shared by the interrupts)."""
    if n not in _references:
        d = tmp_path_factory.mktemp(f"ref{n}")
        res = run(mpirun_cmd(n) + [sys.executable, CKPT_TRAIN, "--ckpt", str(d / "ref-ckpt"),
                                   "--out", str(d / "ref.npz"), "--steps", "24", "--every", "4"],
                  base_env(), timeout=120)
        assert res.returncode == 0, res.stdout[-3000:]
        _references[n] = saved_arrays(d / "ref.npz")
    return _references[n]


@pytest.mark.timeout(400)
# One count each (the USR2 path across two nodes in test_slurm_nodes.py; SIGUSR2 at 1 and 4 ranks without Slurm in
# test_checkpoint_restart.py): 1 and 2 cost 90 s of CI on a slow 2-core machine.  `scontrol requeue` of the same
# script runs at 4 tasks in the next test (a requeue that resumes from disk, then from the node's memory).
@pytest.mark.parametrize("interrupt, n", [("usr2", 3)])
def test_preemptible_job_checkpoints_requeues_and_finishes_like_an_uninterrupted_run(slurm, tmp_path, n,
                                                                                     interrupt, tmp_path_factory):
    ref = reference(n, tmp_path_factory)
    log = tmp_path / "job.log"
    args = [CKPT_TRAIN, "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out.npz"),
            "--steps", "24", "--every", "4", "--step-sleep", "0.4"]
    job = slurm.submit([f"--ntasks={n}", f"--output={log}", str(REPO / "slurm" / "preemptible.sbatch"),
                        "python", *args], cwd=REPO, env=job_env())
    slurm.wait_for_line(log, r"^step 6$", 120)
    if interrupt == "usr2":
        res = slurm.scancel("--signal=USR2", "--batch", job)
    else:
        res = slurm.scontrol("requeue", job)
    assert res.returncode == 0, res.stderr
    slurm.release_after_requeue(job)
    info = slurm.wait(job, 240)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text[-5000:]}\n{slurm.daemon_logs()}"
    starts = [int(s) for s in re.findall(r"^starting at step (\d+)$", text, re.M)]
    assert starts[0] == 0 and len(starts) == 2 and starts[1] >= 4, text[-5000:]   # appended across restarts
    if interrupt == "usr2":
        assert "preempted (SIGUSR2)" in text or "preempted (a signal on another rank)" in text, text[-5000:]
        assert "requeued Slurm job" in text and starts[1] >= 6, text[-5000:]
    assert_bit_identical(saved_arrays(tmp_path / "out.npz"), ref)


@pytest.mark.timeout(400)
def test_a_requeued_job_goes_on_from_the_newest_commit_its_node_kept_in_memory(slurm, tmp_path):
    """examples/elastic_train.py (hpctrain.elastic.run; commits every 4 steps, disk checkpoints every 20) under
    slurm/preemptible.sbatch at 4 tasks, `scontrol requeue` after step 30: the job runs again with the same Slurm
    job id on the same node, loads the disk checkpoint of step 20, then the newest commit the node's memory kept
    (at most one interval before the last step done), and ends bit-identical to an uninterrupted run."""
    from safetensors.numpy import load_file
    from test_elastic import example_args, reference

    log, out = tmp_path / "job.log", tmp_path / "final.safetensors"
    args = ["python", *example_args(out), "--epochs", "3", "--checkpoint-every", "20", "--step-sleep", "0.05",
            "--log-steps"]
    job = slurm.submit(["--ntasks=4", f"--output={log}", str(REPO / "slurm" / "preemptible.sbatch"), *args],
                       cwd=REPO, env=job_env())
    slurm.wait_for_line(log, r"^step 30$", 180)
    res = slurm.scontrol("requeue", job)
    assert res.returncode == 0, res.stderr
    slurm.release_after_requeue(job)
    info = slurm.wait(job, 240)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text[-5000:]}"
    again = text.index("hpctrain: resumed from step 20")
    assert re.search(rf"resumed from node-local commit \d+ \(made by 4 ranks; job slurm-{job}-", text), text[-4000:]
    done = [int(m) for m in re.findall(r"^step (\d+)$", text[:again], re.M)]
    (resumed,) = json.loads(out.with_name(out.name + ".json").read_text())["resumed_at"]
    assert resumed % 4 == 0 and done[-1] - 4 <= resumed <= done[-1], (resumed, done[-3:])
    want, _ = reference(4, [], epochs=3)
    got = load_file(str(out))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [2, 4])
def test_horovod_sbatch_runs_horovodrun_on_the_allocation(slurm, tmp_path, n):
    info, log = sbatch(slurm, tmp_path, n, "horovod.sbatch",
                       ["python", str(REPO / "tests" / "programs" / "hvd_check.py")])
    assert info["JobState"] == "COMPLETED", log[-8000:]
    assert f"size {n} (Slurm tasks {n}) sum {n * (n + 1) // 2}: OK" in log, log[-4000:]


@pytest.mark.timeout(600)
def test_scaling_sbatch_writes_one_table_for_the_sweep(slurm, tmp_path):
    out = tmp_path / "scaling"
    info, log = sbatch(slurm, tmp_path, 4, "scaling.sbatch",
                       ["--models", "mlp", "--peers", "hpctrain", "--rounds", "1", "--windows", "1", "--steps", "2",
                        "--overhead-windows", "0"], timeout=500, HPCTRAIN_SWEEP="1 2 3 4",
                       HPCTRAIN_SCALING_OUT=str(out))
    assert info["JobState"] == "COMPLETED", log[-8000:]
    table = (out / "scaling.md").read_text()
    for n in RANK_COUNTS:
        assert re.search(rf"^\| {n}( \(oversubscribed\))? \| \d", table, re.M), table
    assert (out / "scaling.png").stat().st_size > 0 and (out / "scaling.json").exists()


@pytest.mark.timeout(300)
def test_hostile_paths_and_arguments_survive_the_scripts(slurm, tmp_path):
    odd = tmp_path / "it's a \"home\" dir"
    odd.symlink_to(REPO, target_is_directory=True)
    outdir = tmp_path / "out dir; $(echo no)"
    out = outdir / "sum 'mary' \"x\".json"
    log = tmp_path / "log with space.txt"
    job = slurm.submit(["--ntasks=2", f"--output={log}", str(odd / "slurm" / "train.sbatch"),
                        "python", str(odd / "examples" / "torch_digits.py"), "--epochs", "1", "--out", str(out)],
                       cwd=tmp_path, env=job_env(HPCTRAIN_HOME=str(odd)))
    info = slurm.wait(job, 240)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", text[-4000:]
    assert summary_of(out)["ranks"] == 2
    assert not (tmp_path / "no").exists()
