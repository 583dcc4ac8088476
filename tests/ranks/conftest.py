"""Fixtures for tests that run on every rank of a launch."""
import os

import pytest

import hpctrain


@pytest.fixture(scope="session")
def comm():
    """The world communicator of this launch (the backend comes from the launcher or HPCTRAIN_BACKEND)."""
    c = hpctrain.init()
    expected = os.environ.get("HPCTRAIN_EXPECT_BACKEND")
    assert expected is None or c.backend == expected, f"backend {c.backend}, expected {expected}"
    yield c
    c.barrier()
