"""Run many test files in one multi-rank launch, watch every test on every rank, relaunch after a crash.

Starting a launch costs seconds per rank (python, pytest, torch and TensorFlow
imports), so the files of one configuration (launcher, environment, rank
count) run in one pytest session per rank instead of one launch per file.
Each rank reports its tests as they start and end (rank_report.py); this
module watches those reports while the launch runs:

- a test still running on some rank after its timeout (``@pytest.mark.timeout``
  or HPCTRAIN_TEST_TIMEOUT_S, 240 s) ends the launch and fails that test,
  naming the ranks that were still in it;
- a launch that ends inside a test (a rank died, the stall watchdog aborted
  the job) fails that test, naming the ranks that never finished it;
- either way the tests that had not run yet are launched again (at most
  MAX_LAUNCHES launches), so one broken test does not hide the others.

Outer tests ask :class:`RankSuite` for the verdict of their file
(:meth:`RankSuite.check_file`), which names each failed test and rank.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from harness import REPO, base_env, kill_tree, mpirun_cmd

MAX_LAUNCHES = 6
START_RETRIES = 2   # launches that start no rank at all (mpirun's own start-up failed) are tried again
POLL_S = 0.25
EXIT_GRACE_S = 30   # a launcher still running this long after every rank's session finished is killed
_PYTEST_FRAME = re.compile(r'File ".*(/_pytest/|/pluggy/|rank_main\.py)')


def _kill_leftover(events: List[dict]) -> None:
    """SIGKILL a rank process that outlived its launch (its pid is in its "collected" event)."""
    import psutil
    for ev in events:
        if ev["ev"] == "collected":
            try:
                p = psutil.Process(ev["pid"])
                if any("rank_main.py" in a for a in p.cmdline()):
                    p.kill()
            except psutil.Error:
                pass


class _Watch:
    """Follow one rank's JSON-lines event file as it grows."""

    def __init__(self, path: Path):
        self.path, self.offset, self.buffer = path, 0, ""
        self.events: List[dict] = []
        self.current: Optional[dict] = None      # the start event of the test the rank is in, if any
        self.finished = False                    # its pytest session has ended

    def read(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split("\n")
        for line in filter(str.strip, lines):
            ev = json.loads(line)
            self.events.append(ev)
            if ev["ev"] in ("start", "end"):
                self.current = ev if ev["ev"] == "start" else None
            elif ev["ev"] == "finished":
                self.finished = True


class RankSuite:
    """The results of some test files under tests/ranks run on ``n`` ranks of one launcher and environment."""

    def __init__(self, n: int, files: Sequence[str], launcher: Optional[Callable] = None, select: str = "",
                 limit_s: float = 3600, logs_in: Optional[str] = None, **env):
        self.n, self.files, self.select = n, list(files), select
        self.launcher = launcher or mpirun_cmd
        self.logs_in = logs_in          # where the ranks' logs go (a directory every node sees); default: /tmp
        self.limit_s, self.env = limit_s, env
        self.collected: List[str] = []
        self.results: Dict[str, Dict[int, dict]] = {}     # test id -> rank -> end event
        self.failures: Dict[str, str] = {}                # test id -> why the harness failed it
        self.errors: List[str] = []                       # faults outside any test
        self.launches = 0
        self.wall_s = 0.0

    def run(self) -> "RankSuite":
        """Launch until every collected test has a verdict (or MAX_LAUNCHES launches were spent)."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="hpctrain-ranks-", dir=self.logs_in) as tmp:
            retries = 0
            while self.launches < MAX_LAUNCHES:
                self.launches += 1
                logdir = Path(tmp) / f"launch{self.launches}"
                progressed = self._launch(logdir, Path(tmp) / "done.txt", self.limit_s - (time.monotonic() - start))
                if not progressed and retries < START_RETRIES and self.errors and \
                        not any(logdir.glob("rank*.log")):
                    # The launcher failed before any rank ran (seen once in CI: "The PMIx server's
                    # listener thread failed to start"): not a test's fault; launch again, say so.
                    retries += 1
                    print(f"rank suite: launch {self.launches} started no rank; trying again:\n"
                          f"{self.errors.pop()[-800:]}", file=sys.stderr)
                    continue
                if not progressed or not self._remaining():
                    break
            for tid in self._remaining():
                self.failures[tid] = f"not run: the launches ended before it ({'; '.join(self.errors)[-500:]})"
        self.wall_s = time.monotonic() - start
        return self

    def _remaining(self) -> List[str]:
        return [t for t in self.collected if t not in self.results and t not in self.failures]

    def _command(self, logdir: Path) -> List[str]:
        paths = [str(REPO / "tests" / "ranks" / f) for f in self.files]
        # pytest-timeout is off inside: it would interrupt one rank and leave the others inside a
        # collective; the watcher here ends the whole launch instead (the marker is still read).
        inner = [sys.executable, str(REPO / "tests" / "rank_main.py"), str(logdir), "-q", "-p", "no:cacheprovider",
                 "-p", "no:timeout", "-W", "ignore::pytest.PytestConfigWarning", "--color=no", "--durations=5",
                 *paths]
        return self.launcher(self.n) + inner + (["-k", self.select] if self.select else [])

    def _launch(self, logdir: Path, done_file: Path, limit_s: float) -> bool:
        """Run one launch over the tests not done yet; return True when it settled at least one more test."""
        logdir.mkdir(parents=True)
        done_file.write_text("".join(f"{t}\n" for t in list(self.results) + list(self.failures)))
        before = len(self.results) + len(self.failures)
        cmd = self._command(logdir)
        env = base_env(HPCTRAIN_TEST_INNER_PYTEST=1, HPCTRAIN_TEST_DESELECT=done_file, **self.env)
        with open(logdir / "launcher.log", "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        watches = {r: _Watch(logdir / f"rank{r}.jsonl") for r in range(self.n)}
        deadline = time.monotonic() + max(limit_s, 60)
        hung, finished_at = None, None
        while proc.poll() is None:
            time.sleep(POLL_S)
            for w in watches.values():
                w.read()
            hung = self._overdue(watches)
            if hung or time.monotonic() > deadline:
                time.sleep(2)   # the ranks' own stack dumps at the timeout (rank_report.py) reach their logs
                kill_tree(proc)
                break
            if finished_at is None and all(w.finished for w in watches.values()):
                finished_at = time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > EXIT_GRACE_S:
                # Seen once in CI: after a rank exited with status 1, prterun began to end the job and hung,
                # two ranks left unreaped.  The verdicts are in the ranks' files; a rank that passed everything
                # and still does not exit (a hang at shutdown) fails below, as the launch's exit status says.
                print(f"rank suite: the launcher had not exited {EXIT_GRACE_S} s after every rank finished its "
                      f"tests; killed it", file=sys.stderr)
                kill_tree(proc)
                break
        for w in watches.values():
            w.read()
            _kill_leftover(w.events)
        self._settle(watches, logdir, proc.returncode, hung, timed_out=time.monotonic() > deadline)
        return len(self.results) + len(self.failures) > before

    def _overdue(self, watches: Dict[int, _Watch]) -> Optional[dict]:
        now = time.time()
        for w in watches.values():
            cur = w.current
            if cur and now - cur["t"] > cur["timeout"] + 1:
                return cur
        return None

    def _settle(self, watches, logdir: Path, rc: int, hung: Optional[dict], timed_out: bool) -> None:
        """Record this launch's verdicts: finished tests, the one it ended in, and faults outside tests."""
        for w in watches.values():
            for ev in w.events:
                if ev["ev"] == "collected" and not self.collected:
                    self.collected = ev["ids"]
        ended: Dict[str, Dict[int, dict]] = {}
        started: Dict[str, set] = {}
        for r, w in watches.items():
            for ev in w.events:
                if ev["ev"] == "end":
                    ended.setdefault(ev["id"], {})[r] = ev
                elif ev["ev"] == "start":
                    started.setdefault(ev["id"], set()).add(r)
        for tid, per_rank in ended.items():
            if len(per_rank) == self.n:
                self.results[tid] = per_rank
        broken = [t for t in self.collected if t in started and t not in self.results]
        launcher_log = (logdir / "launcher.log").read_text(errors="replace")[-2500:]
        if broken:
            tid = broken[0]
            done = ended.get(tid, {})
            stuck = sorted(set(range(self.n)) - set(done))
            failed = sorted(r for r, ev in done.items() if ev["outcome"] == "failed")
            died = sorted({int(r) for r in re.findall(r"process rank (\d+)", launcher_log)})
            if hung is not None:
                why = (f"did not finish within its timeout of {hung['timeout']:.0f} s on rank(s) {stuck} "
                       f"(their stacks at the timeout are in their logs); the launch was killed")
            else:
                why = (f"the launch ended (exit status {rc}) inside this test"
                       + (f"; rank(s) {died} died" if died else "") + f"; rank(s) {stuck} never finished it"
                       + (" (the suite's time limit)" if timed_out else ""))
            if failed:
                why += f"; it failed on rank(s) {failed} first:\n{done[failed[0]]['text'][-3000:]}"
            self.failures[tid] = f"{why}\n{self._rank_logs(logdir, stuck)}\n----- launcher -----\n{launcher_log}"
        elif rc != 0 and (self._remaining() or not self.collected or not self._any_failed()):
            self.errors.append(f"launch {self.launches} ended with exit status {rc} outside any test:\n"
                               f"{self._rank_logs(logdir, range(self.n))}\n----- launcher -----\n{launcher_log}")

    def _any_failed(self) -> bool:
        return bool(self.failures) or any(ev["outcome"] == "failed" for per in self.results.values()
                                          for ev in per.values())

    @staticmethod
    def _rank_logs(logdir: Path, ranks, tail: int = 2500) -> str:
        parts = []
        for r in list(ranks)[:4]:
            path = logdir / f"rank{r}.log"
            text = "(no log: the rank never started)"
            if path.exists():   # stack dumps without pytest's own frames
                text = "\n".join(line for line in path.read_text(errors="replace").splitlines()
                                  if not _PYTEST_FRAME.search(line))[-tail:]
            parts.append(f"----- rank {r} -----\n{text}")
        return "\n".join(parts)

    def tests_of(self, file: str) -> List[str]:
        """Return the collected test ids of ``file`` (a name under tests/ranks)."""
        prefix = f"tests/ranks/{file}::"
        return [t for t in self.collected if t.startswith(prefix)]

    def check_file(self, file: str) -> None:
        """Assert that every test of ``file`` passed (or skipped) on every rank; name each failure and rank."""
        ids = self.tests_of(file)
        problems = []
        for tid in ids:
            if tid in self.failures:
                problems.append(f"{tid}: {self.failures[tid]}")
                continue
            bad = {r: ev for r, ev in self.results[tid].items() if ev["outcome"] == "failed"}
            if bad:
                r0 = min(bad)
                problems.append(f"{tid} failed on rank(s) {sorted(bad)} of {self.n}; rank {r0}:\n"
                                f"{bad[r0]['text'][-4000:]}")
        where = f"{file} at {self.n} rank(s) ({' '.join(self._command(Path('LOGDIR'))[:3])} ...)"
        assert not self.errors, f"{where}: " + "\n".join(self.errors)
        assert ids, f"{where}: no test was collected" + (f" for -k {self.select!r}" if self.select else "")
        assert not problems, f"{where}: {len(problems)} of {len(ids)} tests failed\n" + "\n\n".join(problems)

    def check_files(self, files: Sequence[str]) -> None:
        """:meth:`check_file` for each of ``files``, all checked before the first failure is raised."""
        failed = []
        for file in files:
            try:
                self.check_file(file)
            except AssertionError as exc:
                failed.append(str(exc))
        assert not failed, "\n\n".join(failed)

    def slowest(self, k: int = 10) -> List[tuple]:
        """Return the ``k`` slowest inner tests as (seconds, id), the slowest rank's time."""
        times = [(max(ev["duration"] for ev in per.values()), tid) for tid, per in self.results.items()]
        return sorted(times, reverse=True)[:k]


class SuiteCache:
    """Run each (name, n) suite once per outer pytest session and hand out its results.

    A suite runs only the files that the session's selected tests ask for
    (their ``test_file`` parameter, or every file of the suite), so that
    ``-k`` narrows the launch as well as the report.
    """

    def __init__(self, items=()):
        self.suites: Dict[tuple, RankSuite] = {}
        self.wanted: Dict[int, set] = {}
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if "test_file" in params and "n" in params:
                self.wanted.setdefault(params["n"], set()).add(params["test_file"])

    def get(self, name: str, n: int, files: Sequence[str], **kw) -> RankSuite:
        key = (name, n)
        if key not in self.suites:
            if len(files) > 1 and n in self.wanted:
                files = [f for f in files if f in self.wanted[n]]
            self.suites[key] = RankSuite(n, files, **kw).run()
        return self.suites[key]

    def report(self, terminal, k: int = 10) -> None:
        """Write the launches' wall times and the ``k`` slowest inner tests to the terminal summary."""
        if not self.suites:
            return
        terminal.write_sep("=", f"multi-rank launches ({len(self.suites)} suites)")
        for (name, n), suite in self.suites.items():
            terminal.write_line(f"{suite.wall_s:8.1f} s  {name} at {n} rank(s): {len(suite.collected)} tests, "
                                f"{suite.launches} launch(es)")
        terminal.write_sep("=", f"slowest {k} tests inside the launches (slowest rank)")
        rows = sorted(((t, f"{tid} [{name}, {n} ranks]") for (name, n), s in self.suites.items()
                       for t, tid in s.slowest(k)), reverse=True)[:k]
        for t, what in rows:
            terminal.write_line(f"{t:8.2f} s  {what}")
