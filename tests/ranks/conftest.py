"""Fixtures for tests that run on every rank of a launch."""
import os
import shutil
import tempfile

import numpy as np

import pytest

import hpctrain


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
