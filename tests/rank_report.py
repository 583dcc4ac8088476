"""Pytest plugin for the pytest session on each rank of a launch (loaded by rank_main.py).

It writes one JSON line per event to ``<logdir>/rank<r>.jsonl`` as it happens,
so that the outer harness (rank_suite.py) can see which test each rank is in,
fail a test that outlives its timeout or whose rank died, and relaunch the
tests that did not run yet:

    {"ev": "collected", "ids": [...], "pid": ...}           once, after collection
    {"ev": "start", "id": ..., "timeout": seconds}          before a test's set-up
    {"ev": "end", "id": ..., "outcome": ..., "text": ...}   after its tear-down
    {"ev": "finished", "status": ...}                       once, when the session ends

Tests whose ids are listed (one per line) in the file named by
``HPCTRAIN_TEST_DESELECT`` are deselected: they already ran in an earlier launch.
"""
from __future__ import annotations

import faulthandler
import json
import os
import time

import pytest

DEFAULT_TIMEOUT_S = float(os.environ.get("HPCTRAIN_TEST_TIMEOUT_S", "240"))


class RankReport:
    """Write this rank's test events to its JSON-lines file, flushed line by line."""

    def __init__(self, path: str):
        self.out = open(path, "a", buffering=1, encoding="utf-8")
        self.phases: dict = {}
        # The log as it is now: pytest's capture redirects fd 2 during each test.
        self.stacks = os.fdopen(os.dup(2), "w")

    def write(self, **event) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()

    def pytest_configure(self, config):
        config.addinivalue_line("markers", "timeout(seconds): this test's time limit on every rank (the harness's)")

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        path = os.environ.get("HPCTRAIN_TEST_DESELECT")
        if path:
            with open(path, encoding="utf-8") as f:
                done = {line.strip() for line in f if line.strip()}
            keep = [it for it in items if it.nodeid not in done]
            gone = [it for it in items if it.nodeid in done]
            if gone:
                config.hook.pytest_deselected(items=gone)
                items[:] = keep

    def pytest_collection_finish(self, session):
        self.write(ev="collected", ids=[it.nodeid for it in session.items], pid=os.getpid())

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        marker = item.get_closest_marker("timeout")
        timeout = float(marker.args[0]) if marker and marker.args else DEFAULT_TIMEOUT_S
        self.phases[item.nodeid] = []
        self.write(ev="start", id=item.nodeid, timeout=timeout, t=time.time())
        # At the timeout this rank's stacks go to its log: the harness kills the launch a moment later.
        faulthandler.dump_traceback_later(timeout, exit=False, file=self.stacks)

    def pytest_runtest_logreport(self, report):
        phases = self.phases.setdefault(report.nodeid, [])
        phases.append(report)
        if report.when != "teardown":
            return
        faulthandler.cancel_dump_traceback_later()
        failed = [r for r in phases if r.failed]
        skipped = [r for r in phases if r.skipped]
        if failed:
            outcome, text = "failed", "\n".join(f"[{r.when}] {r.longreprtext}" for r in failed)
        elif skipped:
            outcome, text = "skipped", str(skipped[0].longrepr[-1] if isinstance(skipped[0].longrepr, tuple)
                                           else skipped[0].longrepr)
        else:
            outcome, text = "passed", ""
        duration = sum(r.duration for r in phases)
        self.write(ev="end", id=report.nodeid, outcome=outcome, text=text, duration=duration, t=time.time())
        del self.phases[report.nodeid]

    def pytest_sessionfinish(self, session, exitstatus):
        self.write(ev="finished", status=int(exitstatus), t=time.time())
