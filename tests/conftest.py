"""Test configuration: multi-rank files under tests/ranks run inside launches (rank_suite.py); the outer
tests run on two pytest-xdist workers (``make test``), grouped and ordered so that the workers stay busy.

Work units (:func:`work_unit`): the outer tests of one multi-rank suite (one launch per rank count and
configuration) form one unit, so the suite launches once; the Slurm tests share one cluster and the
crash tests share their uninterrupted reference runs, so each file is one unit.  Units are handed
out in collection order, which puts the long and mostly waiting ones (Slurm) and the 4-rank suites
first, so that the short units fill the gaps at the end.
"""
import json
import os
import re

import pytest

if not os.environ.get("HPCTRAIN_INNER_PYTEST"):
    collect_ignore_glob = ["ranks/*"]

# Files whose tests share an expensive module-scoped fixture or cache: one work unit each.
WHOLE_FILE_UNITS = ("test_slurm.py", "test_checkpoint_restart.py")
# Files of outer tests over multi-rank suites (rank_suites): one unit per test function and rank
# count ``n``, which is the last parameter of their ids (test_ranks[test_safety.py-3]).
SUITE_FILES = ("test_multirank.py", "test_horovod.py")


def work_unit(nodeid: str) -> str:
    """The xdist work unit of an outer test: tests of one unit run on one worker, in order."""
    path, _, name = nodeid.partition("::")
    file = os.path.basename(path)
    if file in WHOLE_FILE_UNITS:
        return path
    suite = re.fullmatch(r"(\w+)\[(?:.*-)?(\d+)\]", name)
    if file in SUITE_FILES and suite:
        return f"{path}::{suite[1]}-{suite[2]}"
    return nodeid


# Units of the multi-process tests whose rank count is not in their ids, or that time how fast a job ends.
MULTI_PROCESS_FILES = ("test_checkpoint_restart.py", "test_failures.py")
_RANKS = re.compile(r"[\[-](\d+)\]?$")


def is_light(unit: str) -> bool:
    """Whether a work unit keeps at most one core busy: the Slurm tests (jobs that mostly wait on the
    scheduler and on slow steps), single-process tests and 1-rank launches."""
    file = os.path.basename(unit.partition("::")[0])
    if file == "test_slurm.py":
        return True
    ranks = _RANKS.search(unit)
    return file not in MULTI_PROCESS_FILES and (ranks is None or int(ranks[1]) == 1)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Hand out work units (:func:`work_unit`) in collection order; the last worker takes light units only.

    Two multi-rank launches side by side are no faster than one after the other on a small machine:
    their waiting ranks spin, so each launch slows the other by more than it gains.  A light unit
    beside a multi-rank launch fills the cores it leaves idle.
    """
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return work_unit(nodeid)

        def _assign_work_unit(self, node):
            light_only = len(self.nodes) > 1 and node is self.nodes[-1]
            units = list(self.workqueue)
            if light_only:
                pick = next((u for u in units if is_light(u)), None)
                if pick is None:
                    node.shutdown()
                    return
            else:
                pick = next((u for u in units if not is_light(u)), units[0])
            work = self.workqueue.pop(pick)
            self.assigned_work.setdefault(node, {})[pick] = work
            collection = self.registered_collections[node]
            node.send_runtest_some([collection.index(t) for t, done in work.items() if not done])

    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


def _order(item):
    if item.path.name == "test_slurm.py":
        return (0, 0)
    if "rank_suites" in getattr(item, "fixturenames", ()):
        return (1, -item.callspec.params["n"])
    return (2, 0)


def pytest_collection_modifyitems(config, items):
    """Order the outer tests: Slurm, then the multi-rank suites from 4 ranks down, then the rest."""
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
