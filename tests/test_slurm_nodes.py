"""The sbatch scripts on real Slurm across nodes: one slurmd per fake node, `sbatch --nodes=2`.

slurmctld runs on node1 and a slurmd on each of node1..node3 (tests/slurm_nodes.py);
jobs take 2 nodes x 2 tasks, so srun's ranks cross a shaped TCP link.  Job
output and checkpoints go to the shared directory (each node's /tmp is its
own).  Skipped, with the reason, where the nodes cannot be made; where they
can, a Slurm that cannot be installed or started fails the tests.
"""
import json
import re
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from harness import REPO, assert_bit_identical, base_env, run, saved_arrays
from slurm_cluster import SlurmUnavailable
from slurm_nodes import NodesSlurm

VENV = Path(sys.executable).parent.parent
CKPT_TRAIN = str(REPO / "tests" / "programs" / "ckpt_train.py")
ACROSS = ["--nodes=2", "--ntasks-per-node=2"]
HOSTS = ["node1", "node1", "node2", "node2"]


@pytest.fixture(scope="module")
def slurm(cluster):
    try:
        nodes = NodesSlurm(cluster).start()
    except SlurmUnavailable as exc:
        pytest.fail(f"the multi-node Slurm tests need Slurm's daemons: {exc}", pytrace=False)
    yield nodes
    nodes.stop()


@pytest.fixture
def shared(cluster):
    """A fresh directory of this test in the cluster's shared file system."""
    path = cluster.shared / f"job-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def submit(slurm, shared, script, args, **env):
    log = shared / "job.log"
    job = slurm.submit(ACROSS + [f"--output={log}", str(REPO / "slurm" / script), *args], cwd=REPO,
                       env=base_env(HPCTRAIN_HOME=str(REPO), HPCTRAIN_VENV=str(VENV), **env))
    return job, log


def finished(slurm, job, log, timeout=300):
    info = slurm.wait(job, timeout)
    return info, log.read_text(errors="replace") if log.exists() else "(no log)"


@pytest.mark.timeout(400)
def test_train_sbatch_trains_across_two_nodes(slurm, shared):
    out = shared / "summary.json"
    job, log = submit(slurm, shared, "train.sbatch", ["python", str(REPO / "examples" / "torch_digits.py"),
                                                      "--epochs", "4", "--min-accuracy", "0.9", "--out", str(out)])
    info, text = finished(slurm, job, log)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[1-2]", f"{info}\n{text[-4000:]}"
    assert "4 tasks on 2 node(s)" in text and "launcher srun" in text, text[-4000:]
    summary = json.loads(out.read_text())
    assert summary["hosts"] == HOSTS and summary["replicas_identical"] and summary["test_accuracy"] >= 0.9


@pytest.mark.timeout(400)
def test_horovod_sbatch_runs_horovod_across_two_nodes(slurm, shared):
    job, log = submit(slurm, shared, "horovod.sbatch", ["python", str(REPO / "tests" / "programs" / "hvd_check.py")])
    info, text = finished(slurm, job, log)
    assert info["JobState"] == "COMPLETED", f"{info}\n{text[-4000:]}"
    assert "Horovod on MPI, started by srun on 2 node(s)" in text, text[-4000:]
    assert "backend horovod size 4 (Slurm tasks 4) sum 10: OK" in text and f"hosts {','.join(HOSTS)}" in text, text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("interrupt", ["usr2"])       # (scontrol requeue: tests/test_slurm.py, one node)
def test_preemptible_sbatch_on_two_nodes_is_requeued_and_resumes_bit_identical(slurm, shared, cluster, interrupt):
    train = [CKPT_TRAIN, "--steps", "24", "--every", "4"]
    ref = run(cluster.mpirun(2, 2) + [sys.executable, *train, "--ckpt", str(shared / "ref"),
                                      "--out", str(shared / "ref.npz")], base_env(**cluster.env), 120)
    assert ref.returncode == 0, ref.stdout[-3000:]
    job, log = submit(slurm, shared, "preemptible.sbatch", ["python", *train, "--ckpt", str(shared / "ckpt"),
                                                            "--out", str(shared / "out.npz"), "--step-sleep", "0.4"])
    slurm.wait_for_line(log, r"^step 6$", 120)
    res = slurm.scancel("--signal=USR2", "--batch", job) if interrupt == "usr2" else slurm.scontrol("requeue", job)
    assert res.returncode == 0, res.stderr
    slurm.release_after_requeue(job)
    info, text = finished(slurm, job, log, 240)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", f"{info}\n{text[-5000:]}\n{slurm.daemon_logs()}"
    starts = [int(s) for s in re.findall(r"^starting at step (\d+)$", text, re.M)]
    assert len(starts) == 2 and starts[0] == 0 and starts[1] >= 4, text[-5000:]
    if interrupt == "usr2":       # every rank saved the step of the signal; rank 0 asked for the requeue
        assert "requeued Slurm job" in text and starts[1] >= 6, text[-5000:]
    assert_bit_identical(saved_arrays(shared / "out.npz"), saved_arrays(shared / "ref.npz"))


@pytest.mark.timeout(400)
def test_elastic_sbatch_leaves_a_lost_node_out_and_finishes_on_the_other(slurm, shared, cluster):
    """slurm/elastic.sbatch, 2 nodes x 2 tasks (mpirun with ULFM inside the allocation); node2 loses both
    processes at once (SIGKILL) mid-training: the two ranks of node1 re-form the world within seconds and
    finish, and the job completes.  Against the single-process reference of test_elastic.py with the same
    schedule: equal to 1e-12 (before the loss the sums ran across nodes, in another order than the
    reference's rank order; after it, on one node, in rank order)."""
    from safetensors.numpy import load_file
    from test_elastic import example_args, reference

    out = shared / "final.safetensors"
    job, log = submit(slurm, shared, "elastic.sbatch", ["python", *example_args(out), "--step-sleep", "0.1",
                                                        "--log-steps"], HPCTRAIN_STALL_TIMEOUT_S="60")
    slurm.wait_for_line(log, r"^step 6$", 240)
    cluster.kill("node2", "elastic_train")
    killed_at = time.monotonic()
    slurm.wait_for_line(log, r"re-formed from", 60)
    reformed_after = time.monotonic() - killed_at
    info, text = finished(slurm, job, log)
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "node[1-2]", f"{info}\n{text[-4000:]}"
    assert "4 tasks on 2 node(s)" in text and "launcher mpirun" in text, text[-4000:]
    # Both processes of node2 are named, in one re-forming (4 -> 2), or in two where the second one's failure
    # was reported after the survivors had shrunk the world (4 -> 3 -> 2: a loaded machine)
    said = re.findall(r"hpctrain: world (ranks? [\d-]+) on node node2 failed; the world re-formed from (\d) to (\d)",
                      text)
    assert said in ([("ranks 2-3", "4", "2")], [("rank 2", "4", "3"), ("rank 2", "3", "2")],
                    [("rank 3", "4", "3"), ("rank 2", "3", "2")]), text[-3000:]
    assert reformed_after < 10, f"{reformed_after:.1f} s from the loss of node2 to a re-formed world"
    assert "the elastic job finished with 2 ranks" in text, text[-3000:]
    summary = json.loads(out.with_name(out.name + ".json").read_text())
    assert summary["size"] == 2 and len(summary["resumed_at"]) == len(said), summary
    want, steps = reference(4, [(step, int(size)) for step, (_, _, size) in zip(summary["resumed_at"], said)])
    got = load_file(str(out))
    assert summary["steps"] == steps and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)
