"""Ranks on several real (namespace) nodes: own hostname, /dev/shm, /tmp and a shaped network link each.

2 and 3 nodes x 1 and 2 ranks per node, mpirun from node1 over TCP
(tests/cluster_nodes.py).  The rank files run there unchanged: the
collectives against numpy (every algorithm that can run across nodes, the
hierarchical one bit-identical across ranks and repeats), the layout against
the ranks' hostnames, that no rank sees another node's shared memory or
temporary files, torch and TF training against one process, and checkpoints
in the shared directory.  Then a node is lost: every rank on it is SIGKILLed
at once, the job must end within 30 s naming the node, and a restart resumes
bit-identical from the newest committed checkpoint (in elastic mode the
other node's ranks re-form the world and finish instead:
tests/test_slurm_nodes.py, under slurm/elastic.sbatch).  In elastic mode a
whole node lost, Open MPI's daemon with its ranks, ends Open MPI's job: the
launcher starts it again on the other node, from the newest commit that node kept in its memory (/dev/shm).
Skipped, with the reason, where namespaces cannot be made.
"""
import json
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from harness import BIN, COLLECTIVE_FILES, REPO, assert_bit_identical, base_env, kill_tree, run, saved_arrays

# (2 x 1 and 3 x 2 were left out for CI time: 2 x 2 loses a node's every rank; 3 x 2, one node of three, took 88 s
# on a slow 2-core machine, and the namespace tests of issue 67's silent node deaths will be where such layouts go)
LAYOUTS = [(2, 2)]
COLLECTIVES = ("(world_shape or own_shared_memory or test_allreduce or allgather or broadcast or reduce_scatter "
               "or alltoall or bit_identical or shm_refused or grouped_allreduce_equals or narrow_integer) and not 64mib")
ACROSS = [f for f in COLLECTIVE_FILES if f != "test_point_to_point.py"]    # (the files COLLECTIVES selects from)
TRAINING = ["test_torch_training.py", "test_tf_training.py", "test_checkpoint.py"]
# The rank files run on two layouts that between them have more than one rank a node and more than two
# nodes (6 ranks on 3x2 took three minutes on the 2-core machine).
# Training and checkpoints across nodes run on 2x2 only (CI time: the 3x1 launch took 48 s with torch's training
# and the checkpoints; one rank a node changes nothing in how gradients or checkpoint parts reach hpctrain, and the
# collectives below are what a third node changes).
FILE_LAYOUTS = {(2, 2): ACROSS + TRAINING,
                (3, 1): ACROSS}
# The collectives' million-value sizes (8 MB a call over 1 Gbit/s links) run on 2 x 2, for every dtype with sum
# and every op in float32 (the paths across nodes are the same for each dtype and op; the one-node suites run every
# pair, the others at one of 2-4 ranks each); 3 x 1 runs the other sizes (0, 1, n - 1: its ring and hierarchical forms over three nodes).
SMALL_ON = {(2, 2): " and (not 1000003 or sum or float32)", (3, 1): " and not 1000003"}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("nodes, per_node, test_file",
                         [(nodes, per, f) for (nodes, per), files in FILE_LAYOUTS.items() for f in files])
def test_across_nodes(nodes, per_node, test_file, cluster, rank_suites):
    # One launch a layout.  Temporary directories (the checkpoint tests' own) are in the shared file
    # system, as on a cluster; the node test still looks at each node's own /tmp.
    tmp = cluster.shared / "tmp"
    tmp.mkdir(exist_ok=True)
    files = FILE_LAYOUTS[(nodes, per_node)]
    rank_suites.get(f"nodes-{nodes}x{per_node}", nodes * per_node, files,
                    launcher=lambda n: cluster.mpirun(nodes, per_node), logs_in=str(cluster.shared),
                    select=" or ".join([f"({COLLECTIVES}{SMALL_ON[(nodes, per_node)]})"]
                                       + [f[:-3] for f in files if f not in ACROSS]),
                    HPCTRAIN_TEST_RANKS_PER_NODE=str(per_node), TMPDIR=str(tmp), **cluster.env,
                    ).check_file(test_file)


CKPT_TRAIN = str(REPO / "tests" / "programs" / "ckpt_train.py")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nodes, per_node", LAYOUTS)
def test_sigkill_of_a_whole_node_ends_the_job_naming_it_and_a_restart_resumes_bit_identical(nodes, per_node,
                                                                                            cluster):
    where = cluster.shared / f"node-loss-{nodes}x{per_node}"
    env = base_env(HPCTRAIN_STALL_TIMEOUT_S=60, **cluster.env)

    def train(name, *args):
        return cluster.mpirun(nodes, per_node) + [sys.executable, CKPT_TRAIN, "--ckpt", str(where / name),
                                                   "--out", str(where / f"{name}.npz"), *args]

    reference = run(train("reference"), env, 120)
    assert reference.returncode == 0, reference.stdout[-4000:]
    # Training slowed to 0.2 s a step; once rank 0 has done step 7 (checkpoints of steps 3 and 6 are
    # under way or done), every rank of the last node dies at once by SIGKILL.
    lost = f"node{nodes}"
    job = subprocess.Popen(train("ckpt", "--step-sleep", "0.2"), cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = []
    try:
        for line in job.stdout:
            out.append(line)
            if re.search(r"\bstep 7$", line.strip()):
                break
        cluster.kill(lost, "ckpt_train")
        killed_at = time.monotonic()
        out.append(job.stdout.read())
        job.wait(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        kill_tree(job)
    log = "".join(out)
    assert job.returncode != 0 and "step 7" in log, log[-4000:]
    assert took < 30, f"the job took {took:.1f} s to end after {lost} was lost"
    # hpctrain names the lost node and its ranks (Open MPI's fault-tolerance extension keeps the survivors
    # alive to hear which failed), whichever process notices first; before, that was left to Open MPI's
    # reports, and a survivor's broken TCP link sometimes aborted the job naming nothing lost.
    ranks = list(range((nodes - 1) * per_node, nodes * per_node))
    said = "world rank" + (f"s {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f" {ranks[0]}")
    assert re.search(rf"hpctrain: rank \d+: {said} on node {lost} failed \(the process died or its node was "
                     rf"lost\)", log), log[-4000:]
    assert not (where / "ckpt.npz").exists()
    committed = [int(d.name.split("-")[1]) for d in (where / "ckpt").iterdir() if re.fullmatch(r"step-\d+", d.name)]
    # (the kill lands a few steps after step 7 on a loaded machine: a save of step 9 may be committed by then)
    assert committed and max(committed) in (3, 6, 9), sorted((where / "ckpt").iterdir())
    # The restart (no slowing) resumes from the newest committed checkpoint and ends where the
    # uninterrupted run did, bit for bit.
    resumed = run(train("ckpt"), env, 120)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"starting at step {max(committed)}" in resumed.stdout, resumed.stdout[-3000:]
    assert_bit_identical(saved_arrays(where / "ckpt.npz"), saved_arrays(where / "reference.npz"))


@pytest.mark.timeout(300)
# (ZeRO-2 rides with the discovery script: one launch fewer, about 40 s of CI; neither changes what the other does)
@pytest.mark.parametrize("hosts_from", ["-H", "discovery, --zero 2", "-H, a rank lost before, --reset-limit 1"])
def test_an_elastic_job_that_loses_a_whole_node_goes_on_on_the_other_from_the_newest_commit(hosts_from, cluster):
    """A node crash under ``hpctrain launch --elastic`` (2 nodes x 2 ranks, 3 epochs of 12 steps; every process of
    node2 SIGKILLed at once after step 30, Open MPI's daemon with the ranks): Open MPI's runtime then ends the whole
    job, so the launcher names the node and starts the job again on node1, where the ranks first load the newest
    disk checkpoint (step 20: one every 20 steps) and then the newest commit their node's memory kept (step 28:
    commits every 4 steps, so step 28 or a later one that the ranks reached before the kill landed; /dev/shm is
    each node's own).  The final model equals the single-process reference that went from 4 to 2 ranks at that
    step (to 1e-12: the sums before ran across nodes), and the job's node-local
    commits are gone at its end.  With fixed hosts (-H), and with a discovery script that still lists node2 (the
    launcher leaves it out) together with ZeRO-2 (the momentum is each rank's own chunk: node2's ranks' parts come
    back from their copies on node1's rank 0, their buddy, unless node1's ranks re-formed and committed the resharded
    state before Open MPI's runtime ended them).  And the reset limit across that restart: rank 3 (node2) dies at step 4 and the
    others re-form (reset 1), so with ``--reset-limit 1`` the restart after node2's loss would be reset 2: the
    launcher ends the job instead, saying so."""
    from safetensors.numpy import load_file
    from test_elastic import example_args, reference

    limited = "reset-limit" in hosts_from
    zero = ["--zero", "2"] if "zero" in hosts_from else []
    where = cluster.shared / f"elastic-node-loss-{hosts_from.split(',')[0]}{'-limit' if limited else ''}{'-zero' if zero else ''}"
    where.mkdir()
    out = where / "final.safetensors"
    if hosts_from.startswith("-H"):
        hosts = ["-n", "4", "-H", "node1:2,node2:2"] + (["--reset-limit", "1"] if limited else [])
    else:
        script = where / "discover.sh"
        script.write_text("#!/bin/sh\necho node1:2\necho node2:2\n")
        script.chmod(0o755)
        hosts = ["--min-np", "2", "--host-discovery-script", str(script)]
    kill_after = 10 if limited else 30
    cmd = cluster.launcher("node1") + [str(BIN / "hpctrain"), "launch", "--elastic", *hosts, *example_args(out),
                                       "--step-sleep", "0.1", "--log-steps", "--epochs", "3", "--checkpoint-every",
                                       "20", *zero] + (["--kill", "3:4"] if limited else [])
    job = subprocess.Popen(cmd, cwd=where, env=base_env(HPCTRAIN_STALL_TIMEOUT_S=60, **cluster.env),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, resumed_after = [], None
    try:
        for line in job.stdout:
            lines.append(line)
            if line.strip() == f"step {kill_after}":
                cluster.kill("node2")
                killed_at = time.monotonic()
                break
        for line in job.stdout:
            lines.append(line)
            if "resumed from node-local commit" in line:
                resumed_after = time.monotonic() - killed_at
        job.wait(timeout=120)
    finally:
        kill_tree(job)
    log = "".join(lines)
    if limited:
        assert job.returncode != 0 and "the world re-formed from 4 to 3 ranks" in log, log[-4000:]
        assert ("node node2 was lost with Open MPI's daemon on it, which ends the whole Open MPI job (the survivors' "
                "processes and in-memory commits too); the reset limit (1) is reached (a restart now would be reset "
                "2") in log and "restarting the elastic job" not in log, log[-4000:]
        return
    assert job.returncode == 0, log[-4000:]
    assert re.search(r"hpctrain launch: node node2 was lost with Open MPI's daemon on it, .*restarting the elastic "
                     r"job on node1:2 \(start 2\)", log), log[-4000:]
    assert "hpctrain: resumed from step 20" in log and "the elastic job finished with 2 ranks" in log, log[-4000:]
    # (made by 4 ranks, node2's parts from their copies on node1; or by 2 when node1's ranks re-formed and committed
    # the resharded state at once before Open MPI's runtime ended them, as they mostly do with the heartbeat on: a
    # race, either is that step's state; tests/test_node_commits.py takes a lost rank's part from its copy for sure)
    assert re.search(r"hpctrain: resumed from node-local commit \d+ \(made by [24] ranks", log), log[-4000:]
    assert resumed_after is not None and resumed_after < 20, f"{resumed_after:.1f} s from the loss of node2 to the resumed job"
    summary = json.loads(out.with_name(out.name + ".json").read_text())
    before = [int(m) for m in re.findall(r"^step (\d+)$", log[:log.index("node node2 was lost")], re.M)]
    (resumed,) = summary["resumed_at"]      # (the newest commit: at most one interval before the last step done)
    assert resumed % 4 == 0 and 28 <= resumed and before[-1] - 4 <= resumed <= before[-1], (resumed, before[-3:])
    want, steps = reference(4, [(resumed, 2)], epochs=3)
    got = load_file(str(out))
    assert summary["steps"] == steps
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)
    left = subprocess.run(cluster.launcher("node1") + ["sh", "-c", "ls -A /dev/shm/hpctrain-$(id -u) 2>/dev/null; true"],
                          env={**base_env(), **cluster.env}, capture_output=True, text=True, timeout=30)
    assert left.stdout.strip() == "", f"node-local commits left on node1: {left.stdout}"


@pytest.mark.timeout(150)
# ("auto" hung in about 1 run of 6 until the launcher turned off the TCP transport's emulated put in elastic mode: a
# survivor deadlocked inside Open MPI, its failed put's callback sending a FIN down the connection whose lock the
# failing send held; 0 hangs in 34 runs after, hpctrain/launcher/launch.py.)
@pytest.mark.parametrize("collective", ["auto", "broadcast", "allgather", "native"])
def test_a_rank_killed_inside_a_64mib_collective_across_nodes_re_forms_with_right_results(collective, cluster):
    """Rank 3 (node2) SIGKILLed inside back-to-back 64 MiB collectives across 2 nodes x 2 ranks, elastic mode:
    every result before the failure equals its closed form on every rank (tests/programs/ring_kill.py asserts
    it), and the 3 survivors re-form and all-reduce over the new world.  Open MPI's han (its default across nodes)
    handed the survivors a half-written broadcast buffer and partial sums, with no error; its tuned all-reduce
    and all-gather stalled for good after a TCP readv error in 2 of 4 tries.  So the launcher leaves han out,
    and across nodes a world that re-forms runs hpctrain's ring for all-reduce (``auto``) and all-gather; naming
    the library's all-reduce there is refused in one line."""
    cmd = cluster.launcher("node1") + [str(BIN / "hpctrain"), "launch", "--elastic", "-n", "4", "-H",
                                       "node1:2,node2:2", str(REPO / "tests" / "programs" / "ring_kill.py"), "2",
                                       str(8 * 2 ** 20), collective]
    proc = run(cmd, timeout=100, env=base_env(HPCTRAIN_STALL_TIMEOUT_S=60, **cluster.env))
    log = proc.stdout + proc.stderr
    if collective == "native":
        assert "algorithm='native' is not fault tolerant across nodes" in log, log[-4000:]
        return
    assert proc.returncode == 0, log[-4000:]
    assert "Traceback" not in log and "warning: Open MPI's" not in log, log[-4000:]
    assert len(re.findall(r"^AFTER 6 3 KEPT \d+ CALLS \d+$", log, re.M)) == 3, log[-4000:]
    assert "the elastic job finished with 3 ranks after 1 re-forming" in log, log[-4000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["freeze", "cut"])
def test_an_elastic_job_whose_node_goes_silent_goes_on_in_process_and_ends_by_itself(fault, cluster):
    """A node that goes silent (2 nodes x 2 ranks, after step 10): node2 frozen (every process SIGSTOPped, its
    kernel still answering), or cut off (its link down, its ranks running on, the link up again 20 s later).
    Nothing is closed, so only a heartbeat tells: hpctrain's own (datagrams between the nodes' first ranks, off
    MPI's connections; HPCTRAIN_ELASTIC_SILENT_S = 8 s) declares
    node2's ranks failed to Open MPI.  node1's ranks (half of the world, with rank 0)
    re-form in process from their newest commit (commits every 4 steps: no disk restart), naming node2 and both
    of its ranks at once, and the job ends by itself (the launcher does not wait for node2's daemon nor for an
    output pipe it holds).  A cut-off node's ranks see node1's as failed too, but half of the world without rank 0 is the
    lesser side of a partition: they end, and do not come back when the link does.  The final model equals the
    reference that went from 4 to 2 ranks at the commit the survivors went back to."""
    from safetensors.numpy import load_file
    from test_elastic import example_args, reference

    where = cluster.shared / f"elastic-silent-{fault}"
    where.mkdir()
    out = where / "final.safetensors"
    cmd = cluster.launcher("node1") + [str(BIN / "hpctrain"), "launch", "--elastic", "-n", "4", "-H",
                                       "node1:2,node2:2", *example_args(out), "--step-sleep", "0.1", "--log-steps"]
    job = subprocess.Popen(cmd, cwd=where, env=base_env(HPCTRAIN_STALL_TIMEOUT_S=120, HPCTRAIN_ELASTIC_SILENT_S=8,
                                                        **cluster.env),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, went_on, finished, on_node2, seen = [], None, None, None, []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.strip() == "step 10":
                before = cluster.processes("node2", "elastic_train")
                cluster.fault(fault, "node2")
                fault_at = time.monotonic()
                if fault == "cut":          # (during the partition, after both sides had time to re-form)
                    probe = threading.Timer(15, lambda: seen.append(cluster.processes("node2", "elastic_train")))
                    probe.start()
                break
        reformed = False
        for line in job.stdout:
            lines.append(line)
            reformed = reformed or "the world re-formed" in line
            if reformed and went_on is None and re.fullmatch(r"step \d+\n", line):
                went_on = time.monotonic() - fault_at
            if "the elastic job finished" in line:
                finished = time.monotonic()
        job.wait(timeout=60)
        ended = time.monotonic() - finished if finished else None
        if fault == "cut":
            probe.join()
            time.sleep(max(0.0, fault_at + 20 - time.monotonic()))
            cluster.fault("heal", "node2")
            time.sleep(3)
            on_node2 = seen + [cluster.processes("node2", "elastic_train")]
    finally:
        kill_tree(job)
        cluster.fault("thaw" if fault == "freeze" else "heal", "node2")
        cluster.kill("node2")
    log = "".join(lines)
    said = "".join(line for line in lines if "hpctrain" in line or line.startswith(("step", "finished")))[-3000:]
    assert job.returncode == 0, said + log[-1500:]
    assert re.search(r"hpctrain: world ranks 2-3 on node node2 failed; the world re-formed from 4 to 2 ranks", log), \
        said + log[-1500:]      # (hpctrain's lines first: a crash's stack traces fill the tail)
    assert went_on is not None and went_on < 20, f"{went_on} s from the fault to the next step"     # (8 s + re-forming)
    assert ended is not None and ended < 30, f"the launch ended {ended} s after the job finished"
    assert len(before) == 2, before                  # (the probe sees node2's ranks while they run)
    assert not on_node2 or not any(on_node2), f"node2's ranks ran on, cut off (then healed): {on_node2}"
    summary = json.loads(out.with_name(out.name + ".json").read_text())
    assert summary["size"] == 2 and len(summary["resumed_at"]) == 1 and summary["resumed_at"][0] >= 8, summary
    want, steps = reference(4, [(summary["resumed_at"][0], 2)])
    got = load_file(str(out))
    assert summary["steps"] == steps and sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)
    print(f"{fault}: the next step {went_on:.1f} s after the fault; the launch ended {ended:.1f} s after the job")


def test_cluster_sh_refuses_a_folder_the_nodes_cannot_see_and_says_which_they_can(cluster, tmp_path):
    # Each node has its own /tmp: before, a run from an unkept /tmp folder failed in nsenter, and through
    # mpirun as Open MPI's "daemon failed to report back" (a firewall, it guessed).
    script = REPO / "scripts" / "cluster.sh"
    env = {**base_env(), **cluster.env}
    for argv in (["exec", "node1", "true"], ["mpirun", "-H", "node1:1", "true"]):
        out = subprocess.run([str(script)] + argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 1, (argv, out.stdout, out.stderr)
        assert f"cluster.sh: {tmp_path} is not visible on the nodes: each node has its own /tmp and /dev/shm" \
            in out.stderr and f"{cluster.shared}" in out.stderr and str(REPO) in out.stderr, out.stderr
    seen = subprocess.run([str(script), "exec", "node2", "pwd"], cwd=cluster.shared, env=env, capture_output=True,
                          text=True, timeout=60)
    assert seen.returncode == 0 and seen.stdout.strip() == str(cluster.shared), (seen.stdout, seen.stderr)
