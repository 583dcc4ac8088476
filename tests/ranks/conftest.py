"""Fixtures for tests that run on every rank of a launch."""
import os
import shutil
import tempfile

import numpy as np

import pytest

import hpctrain
from hpctrain.env import detect_launcher


def pytest_configure(config):
    config.addinivalue_line("markers", "share_counts(counts=(1, 2, 3, 4)): the variants of a parametrized test "
                            "share the rank counts instead of each running at every one (CONTRIBUTING, the budget)")


def pytest_collection_modifyitems(config, items):
    """Skip the variants of a ``share_counts`` test that are not this launch's share.

    With counts ``c_0 .. c_{k-1}`` and variants ``v_0 .. v_{m-1}`` (in collection order), variant ``i`` runs at
    count ``c_j`` when ``j mod m == i mod k``: every variant runs at one count at least, and every count runs one
    variant at least.  At a count not listed the first variant runs, so every count still runs the test.
    """
    launch = detect_launcher()
    size = launch.size if launch else 1
    groups = {}
    for item in items:
        mark = item.get_closest_marker("share_counts")
        if mark is not None and hasattr(item, "callspec"):
            groups.setdefault((item.module.__name__, item.originalname), (mark, []))[1].append(item)
    for mark, group in groups.values():
        counts = tuple(mark.kwargs.get("counts", (1, 2, 3, 4)))
        j = counts.index(size) if size in counts else None
        for i, item in enumerate(group):
            runs = i == 0 if j is None else j % len(group) == i % len(counts)
            if not runs:
                at = sorted(c for jj, c in enumerate(counts) if jj % len(group) == i % len(counts))
                item.add_marker(pytest.mark.skip(reason=f"variants share the rank counts: this one runs at {at}"))


@pytest.fixture(scope="session")
def comm():
    """The world communicator of this launch (the backend comes from the launcher or HPCTRAIN_BACKEND)."""
    c = hpctrain.init()
    expected = os.environ.get("HPCTRAIN_TEST_EXPECT_BACKEND")
    assert expected is None or c.backend == expected, f"backend {c.backend}, expected {expected}"
    yield c
    c.barrier()


@pytest.fixture
def ckdir(comm):
    """A fresh directory shared by all ranks (rank 0 creates and removes it)."""
    path = comm.broadcast_object(tempfile.mkdtemp(prefix="hpctrain-ckpt-") if comm.rank == 0 else None)
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def horovod_api():
    """hpctrain.horovod initialised for a module's tests (its negotiation thread), shut down after them."""
    from hpctrain.horovod import basics
    basics.init()
    yield
    basics.shutdown()


def horovod_inputs(shape, dtype=np.float32, seed=0, low=-50, high=50):
    """Every rank's input for a hpctrain.horovod test (a list, rank order), the same on every rank."""
    from hpctrain.horovod import basics
    g = np.random.default_rng(seed)
    return [g.integers(low, high, size=shape).astype(dtype) for _ in range(basics.size())]


@pytest.fixture(scope="session")
def inputs():
    """:func:`horovod_inputs`, for the hpctrain.horovod test files."""
    return horovod_inputs
