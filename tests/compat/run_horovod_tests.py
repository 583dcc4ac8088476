"""Run Horovod 0.28.1's own test files against hpctrain.horovod (or real Horovod), with a hang guard.

Usage (from the repository root; HOROVOD_SRC is a checkout of horovod/horovod at tag v0.28.1)::

    .venv/bin/python tests/compat/run_horovod_tests.py --src HOROVOD_SRC --file test_torch.py \\
        --ranks 2 3 4 [--impl hpctrain|horovod] [--timeout 120] [--out results/compat]

The test file and Horovod's ``test/utils/common.py`` are copied to a scratch
folder; only the import lines change (``horovod.torch`` -> ``hpctrain.horovod.torch``
and likewise for tensorflow/keras and ``horovod.common``; nothing with
``--impl horovod``).  The file runs under ``mpirun -n N python -m pytest``;
the TensorFlow and Keras files with ``TF_USE_LEGACY_KERAS=1`` (Keras 2 from
``tf-keras``, which their Keras 2 code needs) unless ``--keras 3``.  A
test that outlives ``--timeout`` seconds ends that run (pytest-timeout): it
is counted as a hang and the file runs again without the tests that already
have an outcome (so every launch starts with the ranks in step: a test that
fails on some ranks only leaves the others waiting in its next collective,
and that wait is recorded as a hang on either implementation).  Then every
test that failed or hung runs again on its own, in a fresh launch, and both
outcomes are reported.  Writes ``<out>/<file>-<impl>-<N>.json`` with every test's
outcome and prints a summary line per run.  Needs the ``mock`` and
``parameterized`` packages (installed into the venv when missing).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
IMPORTS = [(r"\bimport horovod\.", "import hpctrain.horovod."), (r"\bfrom horovod\.", "from hpctrain.horovod."),
           (r"^import horovod$", "import hpctrain.horovod as horovod")]
# Written into the scratch folder: each rank appends "start <test>" and "<outcome> <test>" lines to its own
# file as it goes, so outcomes survive a run that a hang ends.
CONFTEST = """
import os
_RANK = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "0"
_LOG = open(os.path.join(os.path.dirname(__file__), "outcomes-%s.txt" % _RANK), "a", buffering=1)

def pytest_runtest_logstart(nodeid, location):
    _LOG.write("start %s\\n" % nodeid)

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        outcome = {"passed": "PASSED", "failed": "FAILED", "skipped": "SKIPPED"}[report.outcome]
        if report.when != "call" and report.outcome == "failed":
            outcome = "ERROR"
        _LOG.write("%s %s\\n" % (outcome, report.nodeid))
"""


def rewrite(text: str) -> str:
    """Change only the import lines of a Horovod test file to import hpctrain.horovod."""
    out = []
    for line in text.splitlines(keepends=True):
        if re.match(r"\s*(import|from)\s+horovod\b", line):
            for pattern, repl in IMPORTS:
                line = re.sub(pattern, repl, line.rstrip("\n"), flags=re.M) + "\n"
        out.append(line)
    return "".join(out)


def prepare(src: str, name: str, impl: str, scratch: str) -> str:
    os.makedirs(os.path.join(scratch, "parallel"))
    os.makedirs(os.path.join(scratch, "utils"))
    shutil.copy(os.path.join(src, "test", "utils", "common.py"), os.path.join(scratch, "utils", "common.py"))
    with open(os.path.join(src, "test", "parallel", name)) as f:
        text = f.read()
    for extra in ("base_test_tensorflow.py",):
        path = os.path.join(src, "test", "parallel", extra)
        if os.path.exists(path):
            with open(path) as f:
                body = f.read()
            with open(os.path.join(scratch, "parallel", extra), "w") as f:
                f.write(rewrite(body) if impl == "hpctrain" else body)
    with open(os.path.join(scratch, "parallel", name), "w") as f:
        f.write(rewrite(text) if impl == "hpctrain" else text)
    return os.path.join(scratch, "parallel")


def read_outcomes(folder: str):
    """Return ({test: outcome}, [tests started]) merged over the ranks' files (a failure on any rank wins)."""
    outcomes, started = {}, []
    for name in sorted(os.listdir(folder)):
        if not name.startswith("outcomes-"):
            continue
        with open(os.path.join(folder, name)) as f:
            for line in f:
                kind, _, test = line.strip().partition(" ")
                if kind == "start":
                    if test not in started:
                        started.append(test)
                elif outcomes.get(test) in (None, "PASSED", "SKIPPED"):
                    outcomes[test] = kind
    return outcomes, started


def collect(folder: str, name: str, kfilter: str, env: dict) -> list:
    """Return the ids of the tests pytest selects in ``name`` (collected in one process, no launch)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", name]
    out = subprocess.run(cmd + (["-k", kfilter] if kfilter else []), cwd=folder, env=env, capture_output=True,
                         text=True)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def run_file(folder: str, name: str, ranks: int, timeout: int, kfilter: str, env: dict) -> dict:
    """Run the file until every selected test has an outcome; return {test id: outcome}."""
    outcomes: dict = {}
    bindir = os.path.dirname(sys.executable)
    with open(os.path.join(folder, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    wanted = collect(folder, name, kfilter, env)
    while True:
        for old in os.listdir(folder):
            if old.startswith("outcomes-"):
                os.remove(os.path.join(folder, old))
        cmd = [os.path.join(bindir, "mpirun"), "-n", str(ranks), "--allow-run-as-root", "--oversubscribe",
               "--bind-to", "none", "--mca", "osc", "^ucx", sys.executable, "-m", "pytest", "-p",
               "no:cacheprovider", "-q", f"--timeout={timeout}", "--timeout-method=thread"]
        cmd += [t for t in wanted if t not in outcomes] or [name]
        proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
        seen, started = read_outcomes(folder)
        seen = {t: o for t, o in seen.items() if t not in outcomes}
        hung = [t for t in started if t not in seen and t not in outcomes]
        outcomes.update(seen)
        if hung:
            outcomes[hung[0]] = "HANG"          # the others that started without an outcome run again
        elif not seen:                          # no progress: the launch itself fails
            for t in wanted:
                outcomes.setdefault(t, f"NOT RUN (exit {proc.returncode})")
        if all(t in outcomes for t in wanted):
            return outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="a checkout of horovod/horovod at v0.28.1")
    ap.add_argument("--file", required=True, help="e.g. test_torch.py")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--impl", choices=("hpctrain", "horovod"), default="hpctrain")
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("-k", dest="kfilter", default="not elastic")
    ap.add_argument("--no-rerun-alone", dest="rerun_alone", action="store_false",
                    help="do not run each test that failed or hung again on its own")
    ap.add_argument("--keras", choices=("2", "3"), default="2",
                    help="Keras of the TensorFlow/Keras files: 2 (tf-keras, TF_USE_LEGACY_KERAS=1, as Horovod's "
                         "users keep Keras 2 code on TF >= 2.16) or 3")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "compat"))
    args = ap.parse_args()
    for pkg in ("mock", "parameterized"):
        if subprocess.run([sys.executable, "-c", f"import {pkg}"], capture_output=True).returncode:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", pkg], check=True)
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1",
               OMPI_MCA_threads_pthreads_yield_strategy="nanosleep", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if args.keras == "2" and args.file != "test_torch.py":
        env["TF_USE_LEGACY_KERAS"] = "1"
    for n in args.ranks:
        with tempfile.TemporaryDirectory(prefix="hvdcompat-") as scratch:
            folder = prepare(args.src, args.file, args.impl, scratch)
            t0 = time.time()
            outcomes = run_file(folder, args.file, n, args.timeout, args.kfilter, env)
            alone = {}
            if args.rerun_alone:         # a failure on some ranks only puts the ranks out of step for the next tests
                for test in sorted(t for t, o in outcomes.items() if o not in ("PASSED", "SKIPPED")):
                    alone[test] = run_file(folder, test, n, args.timeout, "", env).get(test, "NOT RUN")
        counts = {k: sum(1 for v in outcomes.values() if v == k) for k in sorted(set(outcomes.values()))}
        record = {"file": args.file, "impl": args.impl, "ranks": n, "seconds": round(time.time() - t0, 1),
                  "counts": counts, "outcomes": outcomes, "alone": alone,
                  "passed_alone": sorted(t for t, o in alone.items() if o == "PASSED")}
        with open(os.path.join(args.out, f"{args.file[:-3]}-{args.impl}-{n}.json"), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        print(f"{args.file} {args.impl} {n} ranks: {counts} in {record['seconds']} s")
        for test, outcome in sorted(outcomes.items()):
            if outcome not in ("PASSED", "SKIPPED"):
                again = f" (run alone: {alone[test]})" if test in alone else ""
                print(f"  {outcome}: {test}{again}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
