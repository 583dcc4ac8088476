"""Test configuration: multi-rank files under tests/ranks run inside launches (rank_suite.py); the outer
tests run on two pytest-xdist workers (``make test``), grouped and ordered so that the workers stay busy.

Work units (``--dist loadgroup``): the outer tests of one multi-rank suite (one launch per rank count
and configuration) form one group, so the suite launches once; the Slurm tests share one cluster and
the crash tests share their uninterrupted reference runs, so each file is one group.  Units are handed
out in collection order, which puts the long and mostly waiting ones (Slurm) and the 4-rank suites
first, so that the short units fill the gaps at the end.
"""
import json
import os

import pytest

if not os.environ.get("HPCTRAIN_INNER_PYTEST"):
    collect_ignore_glob = ["ranks/*"]

WHOLE_FILE_GROUPS = {"test_slurm.py": "slurm", "test_checkpoint_restart.py": "checkpoint-restart"}


def _group(item):
    """The xdist group of an outer test, or None when it can run anywhere on its own."""
    file = item.path.name
    if file in WHOLE_FILE_GROUPS:
        return WHOLE_FILE_GROUPS[file]
    if "rank_suites" in getattr(item, "fixturenames", ()):
        return f"{item.originalname}-{item.callspec.params['n']}"
    return None


def _order(item):
    if item.path.name == "test_slurm.py":
        return (0, 0)
    if "rank_suites" in getattr(item, "fixturenames", ()):
        return (1, -item.callspec.params["n"])
    return (2, 0)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Group and order the outer tests for the xdist workers (before xdist reads the groups)."""
    for item in items:
        group = _group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=_order)      # stable: within a rank of the order, files keep their order


@pytest.fixture(scope="session")
def rank_suites(request):
    """Multi-rank suites of this session, each launched once with the files that the selected tests need."""
    from rank_suite import SuiteCache
    request.config.hpctrain_suites = SuiteCache(request.session.items)
    return request.config.hpctrain_suites


def pytest_sessionfinish(session):
    """On an xdist worker, send the suites' launch times and slowest tests to the controller."""
    cache = getattr(session.config, "hpctrain_suites", None)
    if cache is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["hpctrain_suites"] = json.dumps(cache.summary())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the xdist controller, collect what each worker's suites reported."""
    raw = getattr(node, "workeroutput", {}).get("hpctrain_suites")
    if raw:
        node.config.hpctrain_worker_suites = getattr(node.config, "hpctrain_worker_suites", []) + json.loads(raw)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """End with the launches' times and the slowest tests inside them (the outer durations hide them)."""
    from rank_suite import report
    rows = list(getattr(config, "hpctrain_worker_suites", []))
    cache = getattr(config, "hpctrain_suites", None)
    if cache is not None:
        rows += cache.summary()
    report(terminalreporter, rows)
