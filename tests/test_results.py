"""The pool of large result arrays: a result the caller holds is never handed out again; dropped ones are."""
import numpy as np

from hpctrain.collectives.results import ResultBuffers


def test_held_results_are_never_reused_and_dropped_ones_are():
    pool = ResultBuffers(min_bytes=1024, keep=2)
    a = pool.empty(1000, np.float32)
    a[:] = 1
    b = pool.empty(1000, np.float32)                 # a is held: new memory
    assert not np.shares_memory(a, b)
    view = a.reshape(10, 100)[2:]                    # a view of a keeps its buffer held too
    del a
    c = pool.empty(1000, np.float32)
    assert not np.shares_memory(c, view) and not np.shares_memory(c, b)
    np.testing.assert_array_equal(view, 1)
    address = b.ctypes.data
    del b
    d = pool.empty(250, np.float64)                  # same bytes, another dtype: b's memory again
    assert d.ctypes.data == address and d.dtype == np.float64 and d.shape == (250,)


def test_small_results_and_much_smaller_requests_get_fresh_memory():
    pool = ResultBuffers(min_bytes=1024, keep=2)
    small = pool.empty(10, np.float32)
    assert small.base is None or small.base.nbytes == small.nbytes       # plain np.empty
    big = pool.empty(10_000, np.float32)
    address = big.ctypes.data
    del big
    half = pool.empty(4_000, np.float32)             # would pin a buffer 2.5x its size: not reused
    assert half.ctypes.data != address
    assert len(pool._bufs) <= 2
