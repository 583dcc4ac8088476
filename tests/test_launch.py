"""Launcher detection from each launcher's variables, the launch command, and real launches."""
import os
import re
import subprocess
import sys

import pytest

from hpctrain.env import LaunchInfo, detect_launcher
from hpctrain.launcher.launch import build_command

from harness import BIN, base_env, mpirun_cmd, run


@pytest.mark.parametrize("env, expect", [
    ({}, None),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_RANK": "2"}, LaunchInfo("openmpi", 2, 4, 0, 2)),
    ({"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"},
     LaunchInfo("mpich", 1, 3, 1, 3)),
    ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
      "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}, LaunchInfo("horovod-gloo", 3, 4, 1, 2, 1, 2)),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
      "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, LaunchInfo("slurm", 5, 6, 1, 2, 2, 3)),
    # the batch script of an allocation is not a task of a step
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, None),
])
def test_detect_launcher(env, expect):
    assert detect_launcher(env) == expect


def test_build_command_flags():
    env = {}
    cmd = build_command(3, ["python", "train.py", "--lr", "0.1"], env=env, cores=2)
    assert cmd[0].endswith("mpirun") and cmd[1:3] == ["-n", "3"]
    assert "--oversubscribe" in cmd and ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)
    assert cmd[-6:] == [sys.executable, "-m", "hpctrain.run", "train.py", "--lr", "0.1"]
    assert "--oversubscribe" not in build_command(2, ["x.py"], env=env, cores=2)
    with pytest.raises(ValueError):
        build_command(0, ["x.py"], env=env)
    with pytest.raises(ValueError):
        build_command(2, [], env=env)
    elastic = build_command(3, ["x.py"], env=env, cores=2, elastic=True, min_np=2)
    assert elastic[elastic.index("--with-ft") + 1] == "ulfm" and "--with-ft" not in cmd
    assert "HPCTRAIN_ELASTIC=1" in elastic and "HPCTRAIN_ELASTIC_MIN_NP=2" in elastic
    # (ranks spawned into the running world may fail or end without ending the job: hpctrain.elastic.grow)
    at = elastic.index("--prtemca")
    assert elastic[at + 1:at + 3] == ["state_base_recoverable", "1"] and "--prtemca" not in cmd
    # Open MPI's han and cuda collectives are not fault tolerant (tests/test_multinode.py): left out unless the
    # user chose the components; a rank that may run han in elastic mode says so (han_may_run)
    assert elastic[elastic.index("coll") + 1] == "^han,cuda" and "coll" not in cmd
    assert "coll" not in build_command(3, ["x.py"], env={"OMPI_MCA_coll": "^cuda"}, cores=2, elastic=True)
    from hpctrain.world.lifecycle import han_may_run
    assert [han_may_run({"OMPI_MCA_coll": c}) for c in ("", "^han,cuda", "^cuda", "^ cuda, han", "tuned,han",
                                                           "tuned,basic")] == [True, False, True, False, True, False]
    assert han_may_run({})
    # nor is the TCP transport's emulated put (a survivor deadlocked in it: tests/test_multinode.py); the same
    from hpctrain.world.lifecycle import tcp_put_may_run
    assert elastic[elastic.index("btl_tcp_flags") + 1] == "send,inplace,need-ack,need-csum" and "btl_tcp_flags" not in cmd
    assert "btl_tcp_flags" not in build_command(3, ["x.py"], env={"OMPI_MCA_btl_tcp_flags": "send"}, cores=2,
                                                elastic=True)
    assert [tcp_put_may_run({"OMPI_MCA_btl_tcp_flags": f}) for f in ("", "send,put", "send,inplace,need-ack,need-csum",
                                                                     "1", "3")] == [True, True, False, False, True]
    for bad, said in (({"min_np": 2}, "--elastic"), ({"elastic": True, "min_np": 4}, "between 1 and"),
                      ({"elastic": True, "gloo": True}, "mpirun")):
        with pytest.raises(ValueError, match=said):
            build_command(3, ["x.py"], env=env, cores=2, **bad)


def test_hpctrain_launch_prints_every_rank():
    code = "import hpctrain as h; h.init(); print(h.rank())"
    result = run([str(BIN / "hpctrain"), "launch", "-n", "3", "python", "-c", code], base_env(), 120)
    assert result.returncode == 0, result.stdout
    assert sorted(result.stdout.split()) == ["0", "1", "2"]


def test_hpctrain_info_lists_versions_and_layout():
    result = run([str(BIN / "hpctrain"), "launch", "-n", "2", "hpctrain", "info"], base_env(), 180)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    for word in ("Open MPI", "mpi4py", "numpy", "torch", "tensorflow", "horovod", "launcher   openmpi",
                 "world size 2"):
        assert word in out, f"{word!r} missing from:\n{out}"
    assert "horovod  installed" in out and "mpi      installed" in out
    assert not re.search(r"\bworks\b", out), "info only looks; `hpctrain check` says what works"
    assert out.count("hpctrain info (hpctrain ") == 1, "only rank 0 prints"
    for name in ("native", "ring", "shm", "hierarchical", "doubling"):
        assert re.search(rf"^    \* {name} ", out, re.M), f"algorithm {name} not listed:\n{out}"
    # one node, two ranks: the shared-memory all-reduce up to HPCTRAIN_SHM_SMALL_BYTES (default 256 KiB)
    assert re.search(r"^  auto picks here: 1 KiB -> shm, ", out, re.M), out


def test_hpctrain_version_is_the_installed_distribution():
    from importlib.metadata import version
    result = run([str(BIN / "hpctrain"), "--version"], base_env(), 60)
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip() == f"hpctrain {version('hpctrain')}"


def test_hpctrain_info_imports_no_framework_and_takes_under_two_seconds():
    """The versions come from the installed metadata: torch, TensorFlow and Horovod stay unimported."""
    from importlib.metadata import version
    code = ("import sys, time; from hpctrain.launcher.cli import main; t = time.perf_counter(); main(['info']); "
            "print('elapsed', time.perf_counter() - t); "
            "print('imported', [m for m in ('torch', 'tensorflow', 'horovod') if m in sys.modules])")
    result = run([sys.executable, "-c", code], base_env(), 120)
    assert result.returncode == 0, result.stdout
    out = result.stdout
    assert "imported []" in out, out
    assert float(re.search(r"^elapsed (\S+)", out, re.M).group(1)) < 2.0, out
    for dist in ("torch", "numpy", "mpi4py", "horovod"):
        assert re.search(rf"^  {dist} +{re.escape(version(dist))}\b", out, re.M), f"{dist} version wrong:\n{out}"
    assert re.search(r"^  tensorflow +2\.", out, re.M), out


def test_hpctrain_info_import_imports_and_shows_horovods_controllers():
    result = run([str(BIN / "hpctrain"), "info", "--import"], base_env(), 180)
    assert result.returncode == 0, result.stdout
    assert "controllers: MPI, Gloo" in result.stdout and "horovod  importable" in result.stdout, result.stdout


def test_comm_log_setting_prints_rank_0s_table_at_shutdown():
    code = ("import numpy as np, hpctrain as h; c = h.init(); [c.allreduce(np.ones(256, np.float32)) "
            "for _ in range(4)]; h.shutdown()")
    result = run([str(BIN / "hpctrain"), "launch", "-n", "2", "python", "-c", code],
                 base_env(HPCTRAIN_COMM_LOG="1"), 120)
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("communication log of this rank") == 1, result.stdout
    assert re.search(r"^\| allreduce \| 2 \| 1 KiB \| 4 \| 4 KiB \| ", result.stdout, re.M), result.stdout


def test_hpctrain_check_runs_every_backend_and_framework():
    result = run([str(BIN / "hpctrain"), "check", "--timeout", "150"], base_env(), 600)
    assert result.returncode == 0, result.stdout
    for name, ranks in (("local", "1 rank"), ("mpi", "2 ranks"), ("horovod", "2 ranks"), ("torch", "2 ranks"),
                        ("tensorflow", "2 ranks")):
        assert re.search(rf"^  {name} +works \({ranks}, ", result.stdout, re.M), result.stdout


def test_hpctrain_check_reports_a_failure_with_its_reason():
    env = base_env(HPCTRAIN_STALL_TIMEOUT_S="-1")          # every launch refuses this setting
    result = run([str(BIN / "hpctrain"), "check", "--only", "local", "mpi"], env, 300)
    assert result.returncode == 1, result.stdout
    for name in ("local", "mpi"):
        assert re.search(rf"^  {name} +fails \(\d ranks?\): exit status \d+: .*HPCTRAIN_STALL_TIMEOUT_S='-1': "
                         rf"expected seconds, at least 0", result.stdout, re.M), result.stdout
    result = run([str(BIN / "hpctrain"), "check", "--only", "mpi", "--timeout", "0.5"], base_env(), 120)
    assert result.returncode == 1 and "mpi         fails (2 ranks): no result within 0.5 s" in result.stdout, \
        result.stdout
    bad = subprocess.run([str(BIN / "hpctrain"), "check", "--only", "gloo"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "unknown check(s) gloo; known: local, mpi, horovod" in bad.stderr


def test_hpctrain_launch_bad_arguments_fail_clearly():
    out = subprocess.run([str(BIN / "hpctrain"), "launch", "-n", "0", "x.py"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "at least 1" in out.stderr


@pytest.mark.parametrize("argv, env, said", [
    (["python", "-u", "no_such_script.py"], {}, "no_such_script.py: no such file"),
    (["no_such_script.py", "--epochs", "2"], {}, "no_such_script.py: no such file"),
    (["python", "-c", "print(1)"], {"HPCTRAIN_FUSION_THRESHOLD": "big"},
     "HPCTRAIN_FUSION_THRESHOLD='big': expected bytes"),
])
def test_hpctrain_launch_refuses_a_missing_script_or_a_bad_setting_before_any_rank_starts(argv, env, said):
    out = subprocess.run([str(BIN / "hpctrain"), "launch", "-n", "2"] + argv, capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, **env))
    assert out.returncode == 2 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.startswith(f"hpctrain: error: {said}") and out.stderr.count("\n") == 1, out.stderr


def test_an_unknown_hpctrain_name_is_a_warning_naming_the_closest_setting_once_per_launch(tmp_path):
    script = tmp_path / "one.py"
    script.write_text("import hpctrain\nhpctrain.init()\nprint('ran', hpctrain.rank())\n")
    env = base_env(HPCTRAIN_TIMELIN=str(tmp_path / "t.json"), HPCTRAIN_TEST_ANYTHING="1")
    out = run([str(BIN / "hpctrain"), "launch", "-n", "2", "python", str(script)], env, 60)
    warning = "HPCTRAIN_TIMELIN is not an hpctrain setting and is ignored (did you mean HPCTRAIN_TIMELINE?)"
    assert out.returncode == 0 and out.stdout.count(warning) == 1, out.stdout
    assert out.stdout.count("ran ") == 2 and "HPCTRAIN_TEST_ANYTHING" not in out.stdout
    direct = run(mpirun_cmd(2) + [sys.executable, str(script)], env, 60)
    assert direct.stdout.count(warning) == 1, direct.stdout          # rank 0's init() says it once


def test_horovodrun_flags_of_hpctrain_launch(tmp_path):
    """-np, -H, --hostfile and --gloo as horovodrun takes them; the hosts reach a real 2-rank launch."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    code = "import hpctrain; c = hpctrain.init(); print('rank', c.rank, 'of', c.size, c.backend)"
    for flags in (["-np", "2", "-H", "localhost:2"], ["--num-proc", "2", "--hostfile", str(hostfile)]):
        result = run([str(BIN / "hpctrain"), "launch", *flags, "--verbose", "python", "-c", code], base_env(), 120)
        assert sorted(re.findall(r"rank \d of 2 mpi", result.stdout)) == ["rank 0 of 2 mpi", "rank 1 of 2 mpi"]
        assert ("--host localhost:2" if "-H" in flags else f"--hostfile {hostfile}") in result.stdout
    gloo = build_command(2, ["python", "x.py"], gloo=True, start_timeout=30)
    assert gloo[1:5] == ["--gloo", "-np", "2", "-H"] and gloo[5] == "localhost:2" and "--start-timeout" in gloo
    with pytest.raises(ValueError, match="not both"):
        build_command(2, ["x.py"], hosts="a:1", hostfile=str(hostfile))


def test_horovod_run_returns_every_ranks_result():
    """hpctrain.horovod.run(fn, args, np) as horovod.run: a function on 3 ranks, results in rank order."""
    code = ("import hpctrain.horovod as horovod\n"
            "def work(scale):\n"
            "    import numpy as np, hpctrain\n"
            "    c = hpctrain.init()\n"
            "    return c.rank, float(c.allreduce(np.array([c.rank + 1.0]))[0]) * scale\n"
            "if __name__ == '__main__':\n"
            "    print(horovod.run(work, args=(10,), np=3))\n")
    result = run([sys.executable, "-c", code], base_env(), 180)
    assert "[(0, 60.0), (1, 60.0), (2, 60.0)]" in result.stdout, result.stdout


def _in_new_pid_namespace(cmd):
    """``cmd`` as the first process (pid 1) of a new pid namespace, so the pid mpirun gets is known."""
    return ["unshare", "--pid", "--fork", "--mount-proc", *cmd]


def _leave_a_stale_session_folder(mpirun, env, folder):
    """Start mpirun as pid 1 of a new pid namespace and SIGKILL it once it has its session folder."""
    import time

    from harness import kill_tree
    victim = subprocess.Popen(_in_new_pid_namespace(mpirun + ["sleep", "60"]), env=env, start_new_session=True)
    deadline = time.monotonic() + 30
    try:
        while not (folder.is_dir() and any(f.startswith("pmix.") for f in os.listdir(folder))):
            assert time.monotonic() < deadline and victim.poll() is None, "mpirun never made its session folder"
            time.sleep(0.1)
    finally:
        kill_tree(victim)
        victim.wait(10)
    assert folder.is_dir()


@pytest.mark.timeout(120)
def test_launch_removes_a_killed_mpiruns_session_folder_that_stops_the_next_one_with_its_pid(tmp_path):
    import shutil
    import time

    import psutil
    from harness import kill_tree
    from hpctrain.launcher.launch import remove_stale_session_dirs

    if shutil.which("unshare") is None or subprocess.run(
            _in_new_pid_namespace(["true"]), capture_output=True).returncode != 0:
        pytest.skip("needs unshare and the right to create pid namespaces (root)")
    tmp = tmp_path / "t"
    tmp.mkdir()
    env = base_env(TMPDIR=str(tmp))
    mpirun = [str(BIN / "mpirun"), "-n", "1", "--allow-run-as-root"]
    folder = tmp / "ompi.1"   # pid 1's: every mpirun below is pid 1 of its namespace
    # The fault, unrepaired: an mpirun given a killed one's pid does not start.
    _leave_a_stale_session_folder(mpirun, env, folder)
    plain = subprocess.run(_in_new_pid_namespace(mpirun + ["true"]), env=env, capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode != 0 and "listener thread failed to start" in plain.stdout + plain.stderr, \
        plain.stdout + plain.stderr
    # A live mpirun's folder is not stale.
    live = subprocess.Popen(mpirun + ["sleep", "60"], env=env, start_new_session=True)
    try:
        live_folder = tmp / f"ompi.{live.pid}"
        deadline = time.monotonic() + 30
        while not live_folder.is_dir():
            assert time.monotonic() < deadline, "mpirun never made its session folder"
            time.sleep(0.1)
        assert psutil.Process(live.pid).name() in ("prterun", "mpirun")
        # hpctrain launch, given the killed one's pid, removes its folder (not the live one's) and starts.
        _leave_a_stale_session_folder(mpirun, env, folder)
        launched = subprocess.run(_in_new_pid_namespace([str(BIN / "hpctrain"), "launch", "-n", "1", "python",
                                                         "-c", "print('started')"]),
                                  env=env, capture_output=True, text=True, timeout=60)
        assert launched.returncode == 0 and "started" in launched.stdout, launched.stdout + launched.stderr
        assert live_folder.is_dir() and not folder.exists()
        # The sweep of a whole folder (as tests/conftest.py does) keeps the live launcher's, removes the dead one's.
        _leave_a_stale_session_folder(mpirun, env, folder)
        assert remove_stale_session_dirs(str(tmp)) == [str(folder)]
        assert live_folder.is_dir()
    finally:
        kill_tree(live)
        live.wait(10)


def test_hpctrain_report_draws_a_run_folder_and_refuses_a_folder_without_one(tmp_path):
    make_run = ("import numpy as np, hpctrain; from hpctrain.observe import StepMetrics; c = hpctrain.init(); "
                f"m = StepMetrics(log_dir={str(tmp_path / 'run')!r}, samples_per_step=4, interval=2)\n"
                "for _ in range(5): c.allreduce(np.ones(8)); m.mark()\n"
                "m.close()")
    made = run([str(BIN / "python"), "-c", make_run], base_env(), 120)
    assert made.returncode == 0, made.stdout
    report = run([str(BIN / "hpctrain"), "report", str(tmp_path / "run"), "--out", str(tmp_path / "plots")],
                 base_env(), 120)
    assert report.returncode == 0, report.stdout
    listed = sorted(os.path.basename(p) for p in report.stdout.split())
    assert listed == sorted(os.listdir(tmp_path / "plots")) and "summary.md" in listed and len(listed) == 7
    assert "| 5 |" in (tmp_path / "plots" / "summary.md").read_text()
    missing = run([str(BIN / "hpctrain"), "report", str(tmp_path / "plots")], base_env(), 60)
    assert missing.returncode == 2 and "has no steps.csv" in missing.stdout, missing.stdout


def test_timeline_setting_writes_one_trace_of_every_rank_at_shutdown(tmp_path):
    import json

    path = tmp_path / "trace.json"
    code = ("import numpy as np, hpctrain; c = hpctrain.init(); c.allreduce(np.ones(1000)); "
            "c.allgather(np.ones(3) * c.rank); hpctrain.shutdown()")
    result = run([str(BIN / "hpctrain"), "launch", "-n", "2", "python", "-c", code],
                 base_env(HPCTRAIN_TIMELINE=str(path)), 120)
    assert result.returncode == 0, result.stdout
    trace = json.loads(path.read_text())
    for rank in (0, 1):
        calls = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "collective"]
        assert [(e["name"], e["args"]["bytes"]) for e in calls] == [("allreduce", 8000), ("allgather", 48)], calls


@pytest.mark.parametrize("how", ["no handler", "second ctrl-c"])
def test_ctrl_c_without_a_preemption_save_ends_the_job_in_one_line_and_a_second_one_at_once(how):
    """Ranks with no preemption handler end on the first Ctrl-C (status 130, one line saying by what); ranks that
    ignore it end at once on the second."""
    import signal
    import time

    from harness import REPO, kill_tree

    code = ("import hpctrain, signal, time; hpctrain.init(); print('ready', flush=True); "
            + ("signal.signal(signal.SIGUSR2, signal.SIG_IGN); " if how == "second ctrl-c" else "")
            + "time.sleep(60)")
    proc = subprocess.Popen([str(BIN / "hpctrain"), "launch", "-n", "2", sys.executable, "-c", code], cwd=REPO,
                            env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        ready = 0
        for line in proc.stdout:
            ready += line.strip().endswith("ready")
            if ready == 2:
                break
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        if how == "second ctrl-c":
            time.sleep(1)
            assert proc.poll() is None, "the ranks ignore SIGUSR2: the first Ctrl-C must not end them"
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert time.monotonic() - start < (15 if how == "no handler" else 10)
        assert proc.returncode == 130, out[-3000:]
        said = ("interrupted by SIGINT (Ctrl-C); the ranks were sent SIGUSR2 and ended without a checkpoint"
                if how == "no handler" else "then ended at once by a second Ctrl-C")
        assert said in out, out[-3000:]
    finally:
        kill_tree(proc)


def test_the_elastic_relay_leaves_out_open_mpis_untested_after_failure_boxes_and_nul_bytes():
    """Relay (what hpctrain launch --elastic passes on of mpirun's output): the osc/sm box and its reminders go,
    said once in one line for both streams; other boxes and lines pass unchanged and in order; NUL bytes go."""
    from hpctrain.launcher.mpirun_output import OSC_NOTE, Relay

    rule = b"-" * 74 + b"\n"
    box = [rule, b"WARNING: The selected 'osc' module 'sm' is not tested for post-failure\n",
           b"operation, yet you have requested support for fault tolerance.\n", rule]
    other = [rule, b"prterun noticed that process rank 0 exited on signal 9.\n", rule]
    said, out, err = set(), [], []
    relays = Relay(out.append, said), Relay(err.append, said)
    for line in box + [b"\x00hello\n"] + other + box + [
            b"[vm:123] 2 more processes have sent help message help-osc-sm.txt / ft-untested\n",
            b"[vm:123] Set MCA parameter \"orte_base_help_aggregate\" to 0 to see all help / error messages\n",
            b"bye\n", rule]:
        relays[0].line(line)
    relays[0].close()
    for line in box + [b"on stderr\n"]:
        relays[1].line(line)
    assert out == [OSC_NOTE, b"hello\n", *other, b"bye\n", rule]    # (an unclosed box is passed on at the end)
    assert err == [b"on stderr\n"]
