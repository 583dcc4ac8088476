"""Test configuration: files under tests/ranks run only inside a multi-rank launch (see rank_suite.py)."""
import os

import pytest

if not os.environ.get("HPCTRAIN_TEST_INNER_PYTEST"):
    collect_ignore_glob = ["ranks/*"]


# Modules that bring up the machine's one namespace cluster (scripts/cluster.sh) or a Slurm cluster:
# under pytest-xdist they share one worker, so that no two clusters are up at once.
CLUSTER_MODULES = {"test_multinode", "test_slurm", "test_slurm_nodes"}


def pytest_collection_modifyitems(config, items):
    """Group what must share a pytest-xdist worker (``make test`` runs two): a multi-rank launch's
    tests (one suite at one rank count, launched once per worker that asks for it) and the cluster
    modules. The cluster modules come first: theirs is the longest chain that one worker must run.
    Without xdist the marks do nothing."""
    items.sort(key=lambda it: it.module.__name__.rpartition(".")[2] not in CLUSTER_MODULES)
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if module in CLUSTER_MODULES:
            group = "clusters"
        elif "rank_suites" in getattr(item, "fixturenames", ()):
            params = getattr(getattr(item, "callspec", None), "params", {})
            group = f"{module}::{item.originalname}::{params.get('n')}"
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(autouse=True)
def _no_stale_mpi_sessions():
    """Before each test, remove the session folders of killed mpiruns (a later mpirun given the pid fails)."""
    from hpctrain.launch import remove_stale_session_dirs
    remove_stale_session_dirs()


@pytest.fixture(scope="session")
def rank_suites(request):
    """Multi-rank suites of this session, each launched once with the files that the selected tests need."""
    from rank_suite import SuiteCache
    request.config.hpctrain_suites = SuiteCache(request.session.items)
    return request.config.hpctrain_suites


def pytest_sessionfinish(session):
    """On a pytest-xdist worker, hand this worker's launches to the controller for its summary."""
    cache = getattr(session.config, "hpctrain_suites", None)
    if cache is not None and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["hpctrain_suites"] = cache.summary()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """On the pytest-xdist controller, keep each worker's launches (see pytest_sessionfinish)."""
    summary = getattr(node, "workeroutput", {}).get("hpctrain_suites")
    if summary:
        node.config.__dict__.setdefault("hpctrain_worker_suites", []).append(summary)


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """End with the slowest tests inside the multi-rank launches (the outer durations hide them)."""
    from rank_suite import write_summaries
    cache = getattr(config, "hpctrain_suites", None)
    summaries = [cache.summary()] if cache is not None else getattr(config, "hpctrain_worker_suites", [])
    write_summaries(terminalreporter, summaries)


@pytest.fixture(scope="session")
def cluster():
    """Fake nodes node1..node3 (tests/cluster_nodes.py) for this session's multi-node tests."""
    from cluster_nodes import Cluster, unavailable
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    nodes = Cluster.up()
    yield nodes
    nodes.down()
