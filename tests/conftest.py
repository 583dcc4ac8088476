"""Test configuration: files under tests/ranks run only inside a multi-rank launch (see rank_suite.py)."""
import os

import pytest

if not os.environ.get("HPCTRAIN_TEST_INNER_PYTEST"):
    collect_ignore_glob = ["ranks/*"]


@pytest.fixture(autouse=True)
def _no_stale_mpi_sessions():
    """Before each test, remove the session folders of killed mpiruns (a later mpirun given the pid fails)."""
    from hpctrain.launcher.launch import remove_stale_session_dirs
    remove_stale_session_dirs()


@pytest.fixture(scope="session")
def rank_suites(request):
    """Multi-rank suites of this session, each launched once with the files that the selected tests need."""
    from rank_suite import SuiteCache
    request.config.hpctrain_suites = SuiteCache(request.session.items)
    return request.config.hpctrain_suites


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """End with the slowest tests inside the multi-rank launches (the outer durations hide them)."""
    cache = getattr(config, "hpctrain_suites", None)
    if cache is not None:
        cache.report(terminalreporter)


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
