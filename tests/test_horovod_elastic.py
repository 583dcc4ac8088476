"""Horovod's elastic API (``hvd.elastic``) on hpctrain: a Horovod-style script (tests/programs/hvd_elastic.py)
under ``hpctrain launch --elastic``, ranks leaving for real (SIGKILL, or an uncaught exception).

What Horovod's own judge (test/integration/elastic_common.py) checks of its elastic workers, checked here:
the size of each epoch's world, the rank the new rank 0 started as, how often the training function was
entered (Horovod's rendezvous count), the reset callback's learning rate, and that a job whose ranks all fail
ends with an error; besides, every rank's parameters are identical at the end.
"""
import json

import pytest

from harness import BIN, REPO, base_env, run

PROGRAM = REPO / "tests" / "programs" / "hvd_elastic.py"
TF_PROGRAM = REPO / "tests" / "programs" / "hvd_elastic_tf.py"

# ranks -> (exit spec EPOCH:BATCH:START_RANKS, exit mode, [(size, start rank of rank 0, entered) per epoch])
CASES = {1: ("1:0:0", "exception", None),                      # every rank fails: the job fails
         2: ("0:3:1", "kill", [(1, 0, 2), (1, 0, 2), (1, 0, 2)]),
         3: ("1:2:2", "exception", [(3, 0, 1), (2, 0, 2), (2, 0, 2)]),
         4: ("1:0:0", "kill", [(4, 0, 1), (3, 1, 2), (3, 1, 2)])}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", sorted(CASES))
def test_horovod_style_elastic_script_survives_ranks_leaving(n, tmp_path):
    spec, mode, epochs = CASES[n]
    log = tmp_path / "log.jsonl"
    cmd = [str(BIN / "hpctrain"), "launch", "--elastic", "-n", str(n), str(PROGRAM), "--exit", spec,
           "--exit-mode", mode, "--log", str(log)]
    res = run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=60), 150)
    if epochs is None:
        assert res.returncode != 0, res.stdout[-3000:]
        assert "every rank of the elastic job failed (none ended normally)" in res.stdout, res.stdout[-3000:]
        assert "leaves the job as a failed rank" in res.stdout
        return
    assert res.returncode == 0, res.stdout[-4000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["size"], r["start_rank"], r["entered"]) for r in lines[:-1]] == epochs, lines
    assert all(r["lr"] == pytest.approx(0.01 * r["size"]) for r in lines[:-1]), lines    # the reset callback ran
    assert lines[-1] == {"identical": True, "ranks": epochs[-1][0]}, lines
    assert f"the elastic job finished with {epochs[-1][0]} ranks after 1 re-forming\n" in res.stdout


@pytest.mark.timeout(180)
def test_horovod_style_elastic_script_follows_the_hosts_a_discovery_script_offers(tmp_path):
    """Hosts added (the job restarts on them from the commit) and removed (their ranks leave, the others re-form),
    as in Horovod's judge: epoch 0 on localhost:1, epoch 1 also on 127.0.0.1:2, epoch 2 on 127.0.0.1:2 only."""
    schedule = [["localhost:1"], ["localhost:1", "127.0.0.1:2"], ["127.0.0.1:2"]]
    log = tmp_path / "log.jsonl"
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\n"        # (the epochs logged so far pick the hosts, as in Horovod's judge)
                      f"epoch=$(cat {log} 2>/dev/null | wc -l)\n"
                      "case $epoch in\n"
                      + "".join(f"  {i}) echo '{chr(10).join(h)}';;\n" for i, h in enumerate(schedule[:-1]))
                      + f"  *) echo '{chr(10).join(schedule[-1])}';;\nesac\n")
    script.chmod(0o755)
    cmd = [str(BIN / "hpctrain"), "launch", "--elastic", "--min-np", "1", "--max-np", "3", "--host-discovery-script",
           str(script), str(PROGRAM), "--log", str(log), "--hosts-schedule", json.dumps(schedule)]
    res = run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=60, HPCTRAIN_ELASTIC_DISCOVERY_S=0.2), 150, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["size"], r["start_rank"], r["entered"], r["host"]) for r in lines[:-1]] == \
        [(1, 0, 1, "localhost"), (3, 0, 2, "localhost"), (2, 1, 3, "127.0.0.1")], lines
    assert all(r["lr"] == pytest.approx(0.01 * r["size"]) for r in lines[:-1]), lines    # the reset callbacks ran
    assert lines[-1] == {"identical": True, "ranks": 2}, lines
    assert "hpctrain: the elastic job restarts from commit" in res.stdout
    assert "restarting the elastic job on localhost:1, 127.0.0.1:2" in res.stdout
    assert "its host localhost left the launcher's hosts" in res.stdout
    assert not (tmp_path / ".hpctrain-elastic").exists()          # (the launcher's control folder is removed)


# horovodrun's users launch as `-np 4 --min-np 2 --max-np 4 -H ...`: the start rank 0 SIGKILLed at epoch 1 batch 0
@pytest.mark.timeout(180)
@pytest.mark.parametrize("cooldown", [None, 5])
def test_horovod_style_elastic_script_launched_with_horovodruns_flags_on_fixed_hosts(cooldown, tmp_path):
    """``--max-np`` with fixed hosts (-H): the job starts on every slot up to it.  Without a cooldown range the
    failed rank's host keeps its other rank (3 ranks go on); with ``--blacklist-cooldown-range 5 5`` the host
    is left out as horovodrun blacklists it (its other rank leaves: 2 ranks on 127.0.0.1 from start rank 2, as
    in Horovod's judge, test_fault_tolerance_without_scaling), and 5 s later it is offered again: the world grows
    back to 4 by a restart from the commit (rank 0 waits 2 s before each epoch's batches, so that the news of the
    hosts is acted on within the epoch of the failure, and the cooldown ends before the last)."""
    log = tmp_path / "log.jsonl"
    cmd = [str(BIN / "hpctrain"), "launch", "--elastic", "-np", "4", "--min-np", "2", "--max-np", "4", "-H",
           "localhost:2,127.0.0.1:2", str(PROGRAM), "--exit", "1:0:0", "--exit-mode", "kill", "--log", str(log)]
    if cooldown:
        cmd[9:9] = ["--blacklist-cooldown-range", str(cooldown), str(cooldown)]
        cmd += ["--epochs", "5", "--epoch-pause", "2"]
    res = run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=60, HPCTRAIN_ELASTIC_DISCOVERY_S=0.2), 150, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-4000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    epochs = [(r["size"], r["start_rank"]) for r in lines[:-1]]
    assert all(r["lr"] == pytest.approx(0.01 * r["size"]) for r in lines[:-1]), lines
    if not cooldown:
        assert epochs == [(4, 0), (3, 1), (3, 1)], lines
        assert lines[-1] == {"identical": True, "ranks": 3}, lines
        return
    assert epochs[:2] == [(4, 0), (2, 2)] and epochs[-1] == (4, 0), lines
    sizes = [size for size, _ in epochs]
    grown = sizes.index(4, 1)                                      # (2 ranks until the restart, then 4)
    assert set(sizes[1:grown]) == {2} and set(sizes[grown:]) == {4}, lines
    assert lines[-1] == {"identical": True, "ranks": 4}, lines
    assert "its host localhost left the launcher's hosts" in res.stdout
    assert "hpctrain launch: restarting the elastic job on 127.0.0.1:2, localhost:2 from commit" in res.stdout


@pytest.mark.timeout(180)
def test_horovod_style_tensorflow_elastic_script_survives_a_killed_rank(tmp_path):
    """hvd.elastic.TensorFlowKerasState: 3 ranks, the rank that started as 1 SIGKILLed at epoch 1 batch 2; the
    two others restore the Keras model's and optimizer's variables from the last commit and finish: every
    epoch's size and rank 0, the reset callback's learning rate, identical weights, and the optimizer's
    iteration count of exactly the steps of the final trajectory (3 epochs x 6 batches: the failed step undone)."""
    log = tmp_path / "log.jsonl"
    cmd = [str(BIN / "hpctrain"), "launch", "--elastic", "-n", "3", str(TF_PROGRAM), "--exit", "1:2:1",
           "--log", str(log)]
    res = run(cmd, base_env(HPCTRAIN_STALL_TIMEOUT_S=60), 150)
    assert res.returncode == 0, res.stdout[-4000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["size"], r["start_rank"], r["entered"]) for r in lines[:-1]] == [(3, 0, 1), (2, 0, 2), (2, 0, 2)]
    assert all(r["lr"] == pytest.approx(0.01 * r["size"]) for r in lines[:-1]), lines
    assert lines[-1] == {"identical": True, "ranks": 2, "iterations": 18}, lines


@pytest.mark.timeout(90)
def test_a_rank_killed_inside_a_negotiated_collective_makes_the_others_reset_instead_of_waiting(tmp_path):
    """The collective of a request the negotiation had agreed was running when its rank died: the survivors'
    handles fail (HorovodInternalError), hvd.elastic.run resets on 2 ranks and finishes every step (before, the
    request had left the negotiation's table and its handle was never finished: the survivors waited for ever)."""
    log = tmp_path / "log.jsonl"
    program = REPO / "tests" / "programs" / "hvd_elastic_kill_in_collective.py"
    res = run([str(BIN / "hpctrain"), "launch", "--elastic", "-n", "3", str(program), "--log", str(log)],
              base_env(HPCTRAIN_STALL_TIMEOUT_S=60), 60)          # (about 7 s on 2 cores; the hang never ended)
    assert res.returncode == 0, res.stdout[-4000:]
    assert json.loads(log.read_text()) == {"size": 2, "steps": 6, "entered": 2}
    assert "the elastic job finished with 2 ranks after 1 re-forming\n" in res.stdout
