"""Point-to-point messages on this launch's ranks: send/recv of every dtype, raw bytes, no-copy sends and
``recv_any``, against each sender's known input.
"""
import time

import numpy as np
import pytest

from collective_inputs import DTYPES, data


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_send_recv(comm, dtype):
    n, r = comm.size, comm.rank
    if comm.backend == "horovod":
        with pytest.raises(ValueError, match="point-to-point"):
            comm.send(np.ones(1), dest=0)
        return
    right, left = (r + 1) % n, (r - 1) % n
    x = data(r, 12, dtype, seed=5, shape=(3, 4))
    h = comm.send_async(x, dest=right, tag=7)
    got = comm.recv(source=left, tag=7)
    h.wait()
    assert got.dtype == np.dtype(dtype) and got.shape == (3, 4)
    assert got.tobytes() == data(left, 12, dtype, seed=5, shape=(3, 4)).tobytes()
    # tags keep messages apart, and big messages arrive whole
    big = np.arange(1_000_003, dtype=np.float32) + r
    h1 = comm.send_async(big, dest=right, tag=2)
    h2 = comm.send_async(np.array([r]), dest=right, tag=1)
    small = comm.recv(source=left, tag=1)
    large = comm.recv(source=left, tag=2)
    h1.wait(), h2.wait()
    assert small.tolist() == [left]
    np.testing.assert_array_equal(large, np.arange(1_000_003, dtype=np.float32) + left)
    # a blocking receive (run on the caller's thread) waits for the receives started before it
    h1 = comm.send_async(np.array([r, 5]), dest=right, tag=5)
    h2 = comm.send_async(np.array([r, 4]), dest=right, tag=4)
    pending = comm.recv_async(source=left, tag=4)
    now = comm.recv(source=left, tag=5)
    assert pending.test() and pending.wait().tolist() == [left, 4] and now.tolist() == [left, 5]
    h1.wait(), h2.wait()


def test_send_without_header_arrives_as_its_bytes(comm):
    n, r = comm.size, comm.rank
    if comm.backend == "horovod":
        with pytest.raises(ValueError, match="point-to-point"):
            comm.send_async(np.ones(1), dest=0, header=False)
        return
    right, left = (r + 1) % n, (r - 1) % n
    for rows in (5, 0, 2):                      # the length alone tells the receiver how many rows came
        x = data(r, rows * 6, np.float32, seed=rows, shape=(rows, 6))
        h = comm.send_async(x, dest=right, tag=3, header=False)
        got = comm.recv_bytes(source=left, tag=3)
        h.wait()
        assert got.dtype == np.uint8 and got.shape == (rows * 24,)
        assert got.tobytes() == data(left, rows * 6, np.float32, seed=rows, shape=(rows, 6)).tobytes()


@pytest.mark.parametrize("header", [True, False], ids=["header", "bytes"])
def test_send_without_copy(comm, header):
    """copy=False sends from the caller's memory; after wait() the sender may reuse it and the receiver's data stays."""
    n, r = comm.size, comm.rank
    if comm.backend == "horovod":
        with pytest.raises(ValueError, match="point-to-point"):
            comm.send_async(np.ones(1), dest=0, header=header, copy=False)
        return
    right, left = (r + 1) % n, (r - 1) % n
    x = data(r, 40_000, np.float32, seed=9, shape=(8, 5000))
    h = comm.send_async(x, dest=right, tag=11, header=header, copy=False)
    got = comm.recv(source=left, tag=11) if header else comm.recv_bytes(source=left, tag=11).view(np.float32)
    h.wait()
    x[:] = -1.0                                  # reused after wait(): must not reach the receiver (1 rank: itself)
    want = data(left, 40_000, np.float32, seed=9, shape=(8, 5000))
    assert got.tobytes() == want.tobytes()
    # a non-contiguous source is made contiguous first
    y = data(r, 40, np.float32, seed=3, shape=(8, 5))[:, ::2]
    h = comm.send_async(y, dest=right, tag=12, copy=False)
    got = comm.recv(source=left, tag=12)
    h.wait()
    assert got.tobytes() == np.ascontiguousarray(data(left, 40, np.float32, seed=3, shape=(8, 5))[:, ::2]).tobytes()


def test_recv_any_takes_every_ranks_messages_in_the_order_each_sent_and_waits_no_longer_than_told(comm):
    n, r = comm.size, comm.rank
    if comm.backend == "horovod":
        with pytest.raises(ValueError, match="point-to-point"):
            comm.recv_any(timeout=0.01)
        return
    sends = [comm.send_async(np.array([r, k], np.int64), dest=0, tag=20 + k, header=False) for k in (0, 1)]
    if r == 0:
        got = [comm.recv_any(idle=True) for _ in range(2 * n)]
        for src in range(n):
            assert [(m.tag, m.data.view(np.int64).tolist()) for m in got if m.source == src] == \
                [(20, [src, 0]), (21, [src, 1])]
        start = time.monotonic()
        assert comm.recv_any(timeout=0.05) is None and comm.probe() is None
        assert 0.05 <= time.monotonic() - start < 1.0
    for h in sends:
        h.wait()
    comm.barrier()
    if n > 1:       # from one rank with one tag: a message of another rank or tag waits for its own receive
        if r == n - 1:
            comm.send_async(np.array([7], np.int64), dest=0, tag=31, header=False).wait()
            comm.send_async(np.array([8], np.int64), dest=0, tag=30, header=False).wait()
        if r == 0:
            m = comm.recv_any(source=n - 1, tag=30)
            assert (m.source, m.tag, m.data.view(np.int64).tolist()) == (n - 1, 30, [8])
            assert comm.probe(source=n - 1) == (n - 1, 31)
            assert comm.recv_any(tag=31).data.view(np.int64).tolist() == [7]
        comm.barrier()
