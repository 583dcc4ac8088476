"""Parameter-server training under `hpctrain launch --elastic`: processes killed for real (SIGKILL).

A killed worker: the servers and the other workers finish, the survivors end with the same model. A killed
server: the job ends within seconds naming it; the same command run again resumes from the servers'
checkpoint (the newest one committed before the kill) and ends with the model of a run that was never interrupted (S = 0: the same float operations but
for the order the pushes of one step arrive in).
"""
import json
import re
import time

import numpy as np
import pytest

from harness import BIN, REPO, base_env, run

EXAMPLE = REPO / "examples" / "parameter_server.py"


def launch(n, out, *options, timeout=90, **env):
    start = time.monotonic()
    res = run([str(BIN / "hpctrain"), "launch", "--elastic", "-n", str(n), str(EXAMPLE), "--out", str(out),
               *map(str, options)], base_env(**env), timeout)
    return res, time.monotonic() - start


def finals(out, workers):
    from safetensors.numpy import load_file

    return {w: load_file(f"{out}.worker{w}") for w in workers if (out.parent / f"{out.name}.worker{w}").exists()}


@pytest.mark.parametrize("n", [3, 4])
def test_a_killed_worker_does_not_stop_the_servers_or_the_other_workers(n, tmp_path):
    out = tmp_path / "ps"
    res, _ = launch(n, out, "--steps", 150, "--staleness", 1, "--slow", 0.005, "--kill", "1:20")
    assert res.returncode == 0, res.stdout[-4000:]
    survivors = [w for w in range(n - 1) if w != 1]
    assert "worker rank 1 failed; going on with worker" in res.stdout, res.stdout[-3000:]
    got = finals(out, range(n - 1))
    assert sorted(got) == survivors, res.stdout[-3000:]
    first = got[survivors[0]]
    for w in survivors[1:]:
        assert all(np.array_equal(first[k], got[w][k]) for k in first), "the surviving workers' final models differ"
    summary = json.loads((tmp_path / "ps.json").read_text())
    assert summary["start_step"] == 0 and summary["last_loss"] < 0.5, summary


@pytest.mark.parametrize("n, servers", [(3, 1), (4, 2)])
def test_a_killed_server_ends_the_job_naming_it_and_a_rerun_resumes_from_its_checkpoint(n, servers, tmp_path):
    common = ["--steps", 60, "--staleness", 0, "--servers", servers, "--checkpoint-every", 10]
    ref, _ = launch(n, tmp_path / "ref", *common, "--checkpoint-dir", tmp_path / "ck-ref")
    assert ref.returncode == 0, ref.stdout[-4000:]
    killed = n - 1                  # (the last server)
    res, took = launch(n, tmp_path / "ps", *common, "--checkpoint-dir", tmp_path / "ck", "--kill", f"{killed}:25")
    assert res.returncode != 0
    assert (f"parameter server rank {killed} (shard {servers - 1} of {servers}) failed" in res.stdout
            and f"resume from the servers' newest checkpoint in {tmp_path / 'ck'}" in res.stdout), res.stdout[-4000:]
    assert took < 45, f"the job took {took:.0f} s to end after its server was killed"
    again, _ = launch(n, tmp_path / "ps", *common, "--checkpoint-dir", tmp_path / "ck")
    assert again.returncode == 0, again.stdout[-4000:]
    # the newest committed checkpoint: step 20 (or 10 when the kill, 5 steps later, beat step 20's commit)
    resumed = re.search(r"resumed from step (\d+)", again.stdout)
    assert resumed and int(resumed.group(1)) in (10, 20), again.stdout[-3000:]
    summary = json.loads((tmp_path / "ps.json").read_text())
    assert summary["start_step"] == int(resumed.group(1))
    # the servers' count of applied gradients is the job's, not the rerun's: a budget spans the restart
    assert summary["global_steps"] == json.loads((tmp_path / "ref.json").read_text())["global_steps"] == 60 * (n - servers)
    want, got = finals(tmp_path / "ref", [0])[0], finals(tmp_path / "ps", [0])[0]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-13)


def test_servers_and_finished_workers_wait_past_the_stall_timeout_without_being_stopped(tmp_path):
    """A server between requests and a worker that finished wait by design: the stall watchdog leaves them be."""
    res, _ = launch(3, tmp_path / "ps", "--steps", 2, "--staleness", -1, "--slow", 2.5,
                    HPCTRAIN_STALL_WARNING_S="1", HPCTRAIN_STALL_TIMEOUT_S="1.5")
    assert res.returncode == 0, res.stdout[-4000:]
    assert "stalled" not in res.stdout and "has not finished" not in res.stdout, res.stdout[-3000:]


def test_a_diverging_run_ends_naming_the_step_instead_of_training_on_nan(tmp_path):
    """lr 0.3, momentum 0.7 with stale gradients diverges on this regression: once every worker's gradient is not
    finite the servers end the job saying so (before that each worker's first such gradient is named)."""
    res, _ = launch(3, tmp_path / "ps", "--steps", 1000, "--staleness", 4, "--lr", 0.3, "--momentum", 0.7)
    assert res.returncode != 0, res.stdout[-3000:]
    assert re.search(r"worker rank \d's gradient of step \d+ holds NaN or infinite values; skipped", res.stdout)
    assert re.search(r"every training worker's last 3 gradients held NaN or infinite values \(step \d+\): the "
                     r"training diverged; lower the servers' lr or momentum", res.stdout), res.stdout[-3000:]
    assert not (tmp_path / "ps.json").exists()


def one_process_reference(sizes, lr=0.1, batch_size=16):
    """The example's servers at S = 0 without momentum, in one process: for each ``(steps, workers)`` of
    ``sizes`` in turn, every worker's gradient at the same parameters, each applied as ``theta -= lr g / W``."""
    import sys

    import torch

    sys.path.insert(0, str(EXAMPLE.parent))
    from parameter_server import batch, make_model

    model = make_model()
    params = list(model.parameters())
    step = 0
    for steps, workers in sizes:
        for step in range(step, steps):
            grads = []
            for w in range(workers):
                model.zero_grad()
                x, y = batch(w, step, batch_size)
                torch.nn.functional.mse_loss(model(x), y).backward()
                grads.append([p.grad.clone() for p in params])
            with torch.no_grad():
                for g in grads:
                    for p, gp in zip(params, g):
                        p -= lr * (gp * (1.0 / workers))
        step = steps
    return {n: t.detach().numpy() for n, t in model.named_parameters()}


def test_a_rerun_with_another_number_of_workers_goes_on_from_the_servers_checkpoint(tmp_path):
    """30 steps of 2 workers and a server, then the same checkpoint directory with 3 workers to step 60: every
    worker starts at the servers' step, the count of applied gradients goes on, and the model equals the
    one-process computation through the same numbers of workers (S = 0: the same float operations but for the
    order the pushes of one step arrive in)."""
    common = ["--staleness", 0, "--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", 10]
    first, _ = launch(3, tmp_path / "a", "--steps", 30, *common)
    assert first.returncode == 0, first.stdout[-4000:]
    again, _ = launch(4, tmp_path / "b", "--steps", 60, *common)
    assert again.returncode == 0, again.stdout[-4000:]
    assert "resumed from step 30" in again.stdout, again.stdout[-3000:]
    summary = json.loads((tmp_path / "b.json").read_text())
    assert (summary["start_step"], summary["workers"], summary["global_steps"]) == (30, 3, 30 * 2 + 30 * 3), summary
    want = one_process_reference([(30, 2), (60, 3)])
    got = finals(tmp_path / "b", range(3))
    assert sorted(got) == [0, 1, 2]
    for w in got:
        for k in want:
            np.testing.assert_allclose(got[w][k], want[k], rtol=1e-10, atol=1e-12, err_msg=f"worker {w}: {k}")
