"""Commits kept in the node's memory (/dev/shm): private files checked when read, the job's identity, stale folders
cleaned, a full file system survived, and a job killed whole that goes on from its newest commit when run again.

The node-loss restart across namespace nodes is in tests/test_multinode.py.
"""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time

import numpy as np
import pytest

from harness import BIN, base_env, kill_tree, run

from hpctrain.checkpoint.node_storage import NodeFolder, NodeLocalStorage, job_id
from hpctrain.checkpoint.state import unpack


def values(step):
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((64, 3)), "b": np.arange(step, step + 5, dtype=np.int64), "step": step}


def test_node_local_storage_keeps_the_newest_commits_as_private_files_checked_when_read(tmp_path):
    folder = NodeFolder(str(tmp_path), job="job-a")
    assert folder.open()
    store = NodeLocalStorage(2, folder, lambda: (3, 1, 0, 1))
    for step in (1, 2, 3):
        store.save(step, values(step))
    store.wait()
    records = sorted(folder.parts(), key=lambda r: r["number"])
    assert [(r["generation"], r["epoch"], r["number"], r["rank"], r["size"]) for r in records] == \
        [(3, 1, 2, 0, 1), (3, 1, 3, 0, 1)]
    assert stat.S_IMODE(os.stat(folder.user_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder.path).st_mode) == 0o700
    names = os.listdir(folder.path)     # (the records, and the buffers the commits are packed into: 2 + a spare)
    assert sorted(n for n in names if n.endswith(".json")) == ["g3-e1-c2-r0of1.json", "g3-e1-c3-r0of1.json"]
    assert len([n for n in names if n.startswith("buf-")]) == 3 and len(names) == 5, names
    for name in names:
        assert stat.S_IMODE(os.stat(os.path.join(folder.path, name)).st_mode) == 0o600, name
    for record in records:
        got, want = unpack(folder.read(record), record["crc"]), values(record["number"])
        assert sorted(got) == sorted(want) and got["step"] == want["step"]
        np.testing.assert_array_equal(got["w"], want["w"])
        np.testing.assert_array_equal(got["b"], want["b"])
    with open(os.path.join(folder.path, records[1]["data"]), "r+b") as f:     # (one bit of its bytes flipped)
        f.seek(records[1]["nbytes"] - 3)
        byte = f.read(1)[0]
        f.seek(records[1]["nbytes"] - 3)
        f.write(bytes([byte ^ 0x40]))
    with pytest.raises(ValueError, match="does not match its record"):
        folder.read(records[1])
    # a record of another job copied into this job's folder is not read
    other = dict(json.load(open(os.path.join(folder.path, records[0]["stem"] + ".json"))), job="job-b")
    json.dump(other, open(os.path.join(folder.path, "g9-e0-c9-r0of1.json"), "w"))
    assert max(r["number"] for r in folder.parts()) == 3
    store.remove(3)
    assert [r["number"] for r in folder.parts()] == [2]
    assert len([n for n in os.listdir(folder.path) if n.startswith("buf-")]) == 2     # (2's, and 3's as the spare)


def test_a_user_folder_that_others_may_enter_is_refused_with_one_warning_and_commits_stay_in_memory(tmp_path, capfd):
    user_dir = tmp_path / f"hpctrain-{os.getuid()}"
    user_dir.mkdir(mode=0o755)
    user_dir.chmod(0o755)
    folder = NodeFolder(str(tmp_path), job="job-a")
    assert not folder.open()
    store = NodeLocalStorage(2, folder, lambda: (1, 0, 0, 1))
    for step in (1, 2, 3):
        store.save(step, values(step))
    store.wait()
    assert store.read(3)["step"] == 3 and not (user_dir / "job-a").exists()
    err = capfd.readouterr().err
    assert err.count("node-local commits are off") == 1 and "not a folder of this user's alone" in err, err


def test_the_job_is_named_by_its_folder_command_line_and_slurm_job_or_by_the_setting():
    one = job_id({}, ["train.py", "--lr", "1"], "/a")
    assert one == job_id({}, ["train.py", "--lr", "1"], "/a") and one.startswith("cmd-")
    assert one != job_id({}, ["train.py", "--lr", "2"], "/a") and one != job_id({}, ["train.py", "--lr", "1"], "/b")
    slurm = job_id({"SLURM_JOB_ID": "123"}, ["train.py", "--lr", "1"], "/a")
    assert slurm.startswith("slurm-123-") and slurm != job_id({"SLURM_JOB_ID": "124"}, ["train.py", "--lr", "1"], "/a")
    assert job_id({"HPCTRAIN_JOB_ID": "run 7/../x"}, ["train.py"], "/a") == "run_7_.._x"


def test_folders_of_jobs_whose_processes_are_gone_are_removed_once_old_and_others_are_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import psutil

    me = {"pid": os.getpid(), "started": psutil.Process().create_time()}
    gone = {"pid": dead.pid, "started": time.time() - 5}
    for job, who, age in (("dead-old", gone, 3600), ("dead-new", gone, 0), ("alive-old", me, 3600)):
        folder = NodeFolder(str(tmp_path), job=job)
        assert folder.open()
        record = os.path.join(folder.path, "g1-e0-c1-r0of1.json")
        json.dump(dict(who, job=job, host=os.uname().nodename), open(record, "w"))
        old = time.time() - age
        for path in (record, folder.path):
            os.utime(path, (old, old))
    mine = NodeFolder(str(tmp_path), job="mine")
    assert mine.open()
    assert mine.clean_stale(600) == ["dead-old"]
    assert sorted(os.listdir(mine.user_dir)) == ["alive-old", "dead-new", "mine"]


def example(out, *more):
    """The elastic example, 3 epochs at 2 ranks (72 steps), commits every 4 steps, disk checkpoints every 20."""
    from test_elastic import example_args

    return [str(BIN / "hpctrain"), "launch", "--elastic", "-n", "2", *example_args(out), "--epochs", "3",
            "--checkpoint-every", "20", *more]


@pytest.mark.timeout(180)
# (ZeRO-2 only: a replicated state's restart from the node's memory runs in tests/test_slurm.py's requeue and
# tests/test_multinode.py's node loss; this one adds each rank's part and its copy)
@pytest.mark.parametrize("options", [("--zero", "2")], ids=["zero2"])
def test_a_job_killed_whole_and_run_again_goes_on_from_its_newest_node_local_commit(options, tmp_path):
    """Every process of a 2-rank elastic job SIGKILLed after step 30, then the same command run again in the same
    folder: it loads the disk checkpoint of step 20, then the newest commit the node's memory kept (at most one
    commit interval before the last step done), and ends with the model of an uninterrupted run (bit-identical:
    one node, the same sizes), its node-local commits removed.  With ZeRO-2 the momentum is each rank's own
    chunk, kept as a part and a copy on the other rank: rank 1's own parts are removed before the rerun (as if
    its node's memory were lost), so its chunk comes back from the copy rank 0's node kept."""
    from safetensors.numpy import load_file
    from test_elastic import reference

    out = tmp_path / "final.safetensors"
    user_dir = f"/dev/shm/hpctrain-{os.getuid()}"
    before = set(os.listdir(user_dir)) if os.path.isdir(user_dir) else set()
    env = base_env(HPCTRAIN_STALL_TIMEOUT_S=60)
    command = example(out, "--step-sleep", "0.05", "--log-steps", *options)
    job = subprocess.Popen(command, cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.strip() == "step 30":
                kill_tree(job)      # (every process: the launcher, prterun and the ranks, in their own sessions)
                break
        lines.extend(job.stdout)
        job.wait(timeout=30)
    finally:
        kill_tree(job)
    done = [int(m) for m in re.findall(r"^step (\d+)$", "".join(lines), re.M)]
    left = set(os.listdir(user_dir)) - before
    assert len(left) == 1, (left, "".join(lines)[-2000:])
    (folder,) = left
    names = os.listdir(os.path.join(user_dir, folder))
    assert any(name.endswith(".json") for name in names) and any(name.startswith("buf-") for name in names), names
    if options:         # (each rank's own part and the other rank's copy; rank 1's own parts go, as with its node)
        assert any(re.search(r"-soptimizer-by\d\.part$", name) for name in names), names
        own = [name for name in names if re.search(r"-r1of2-soptimizer\.(json|part)$", name)]
        assert own, names
        for name in own:
            os.remove(os.path.join(user_dir, folder, name))
    again = run(command, env, 120, cwd=tmp_path)    # (the same command)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-4000:]
    assert "hpctrain: resumed from step 20" in log and re.search(r"resumed from node-local commit \d+ \(made by 2 "
                                                                 r"ranks; job " + folder, log), log[-4000:]
    (resumed,) = json.loads(out.with_name(out.name + ".json").read_text())["resumed_at"]
    assert resumed % 4 == 0 and done[-1] - 4 <= resumed <= done[-1], (resumed, done[-3:])
    want, steps = reference(2, [], epochs=3)
    got = load_file(str(out))
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert not os.path.exists(os.path.join(user_dir, folder)), os.listdir(os.path.join(user_dir, folder))


@pytest.mark.timeout(120)
def test_a_full_node_file_system_turns_node_local_commits_off_with_one_warning_and_training_goes_on(tmp_path):
    """HPCTRAIN_NODE_COMMIT_DIR on a 16 KiB tmpfs (a private mount namespace), too small for a commit of the
    example's state (48 KiB): one warning, the commits stay in memory, and training ends with the model of the
    reference."""
    from safetensors.numpy import load_file
    from test_elastic import reference

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a small tmpfs of its own needs root and unshare")
    small = tmp_path / "shm"
    small.mkdir()
    out = tmp_path / "final.safetensors"
    inner = " ".join(f"'{a}'" for a in example(out))
    res = run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
               f"mount -t tmpfs -o size=16k,mode=1777 small '{small}' && exec {inner}"],
              base_env(HPCTRAIN_NODE_COMMIT_DIR=str(small), HPCTRAIN_STALL_TIMEOUT_S=60), 100, cwd=tmp_path)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert log.count("node-local commits are off") == 1 and "bytes free, a part needs" in log, log[-4000:]
    want, _ = reference(2, [], epochs=3)
    got = load_file(str(out))
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert os.listdir(small) == []      # (the host's folder under the private tmpfs was never written)


@pytest.fixture
def world_of_one():
    import hpctrain

    hpctrain.shutdown()
    yield hpctrain.init("local")
    hpctrain.shutdown()


def test_a_node_local_commit_that_does_not_fit_the_program_is_refused_in_one_line_naming_its_folder(
        world_of_one, tmp_path, monkeypatch):
    """A commit left by the same job name whose model had other shapes: the start refuses it with a CheckpointError
    (one line on rank 0, alike on every rank) naming the folder and how to start afresh; one that fits is taken."""
    import torch

    from hpctrain.elastic import node_resume
    from hpctrain.errors import CheckpointError
    from hpctrain.torch import TorchState

    monkeypatch.setenv("HPCTRAIN_NODE_COMMIT_DIR", str(tmp_path))
    monkeypatch.setenv("HPCTRAIN_JOB_ID", "same-name")
    first = TorchState(torch.nn.Linear(4, 3), None, step=7)
    assert node_resume.start(first, world_of_one, False) is None      # (nothing kept yet)
    first.save()
    first.leave_node()
    fits = TorchState(torch.nn.Linear(4, 3), None, step=0)
    loaded = node_resume.start(fits, world_of_one, False)
    assert loaded is not None and loaded["size"] == 1 and fits.step == 7
    assert torch.equal(fits.model.weight, first.model.weight)
    fits.leave_node()
    other = TorchState(torch.nn.Linear(5, 3), None, step=0)
    with pytest.raises(CheckpointError, match=r"node-local commit of this job \(.*same-name\) does not fit"):
        node_resume.start(other, world_of_one, False)
