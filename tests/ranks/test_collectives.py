"""Every collective, dtype, op and root on this launch's ranks, against a numpy reference.

Each rank can compute every other rank's input (``data(rank, ...)`` is
deterministic), so the reference is computed locally with numpy.  Inputs are
small integers stored in each dtype: sums, products, minima and maxima of
them are exact in every dtype and every summation order, so results must
match the reference exactly, and the ``avg`` reference divides the exact sum
the same way.  A separate test uses real-valued floats with a tolerance and
checks that all ranks get bit-identical bits.
"""
import hashlib
import itertools
import os
import socket
import time

import numpy as np
import pytest

import hpctrain
from hpctrain.collectives.ops import segment_bounds
from hpctrain.tensors import BFLOAT16

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_]
OPS = ["sum", "avg", "min", "max", "prod"]
SIZES = ["0", "1", "n-1", "1000003"]
BIG = 64 << 20  # 64 MiB



def data(rank, count, dtype, op="sum", seed=0, shape=None):
    """Return rank's deterministic input: small integers chosen so every reduction is exact."""
    rng = np.random.default_rng([seed, rank, count])
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        v = rng.integers(0, 2, count).astype(bool)
    elif op == "prod":
        v = rng.choice(np.array([1, 2] if dtype.kind == "u" else [-2, -1, 1, 2]), count)
    elif dtype.kind == "u":
        v = rng.integers(0, 60, count)
    else:
        v = rng.integers(-30, 31, count)
    v = np.asarray(v).astype(dtype)
    return v.reshape(shape) if shape is not None else v


def acc_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(np.float16), BFLOAT16):
        return np.float32
    return np.uint8 if dtype == np.bool_ else dtype


def reference(inputs, op, n):
    dtype = inputs[0].dtype
    stack = np.stack([x.astype(acc_dtype(dtype)) for x in inputs])
    if op in ("sum", "avg"):
        out = stack.sum(axis=0, dtype=stack.dtype)
    elif op == "prod":
        out = stack.prod(axis=0, dtype=stack.dtype)
    else:
        out = stack.min(axis=0) if op == "min" else stack.max(axis=0)
    if op == "avg":
        out = out / out.dtype.type(n)
    return out.astype(dtype)


def valid(dtype, op):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return op in ("min", "max")
    return not (op == "avg" and dtype.kind in "iu")


def same_on_all_ranks(comm, arr):
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    return len(set(comm.allgather_object(digest))) == 1


def algorithms(comm):
    """Every allreduce algorithm that can run on this launch ("shm" needs one node)."""
    return [a for a in comm.allreduce_algorithms() if not (a == "shm" and comm.topology.num_nodes > 1)]


def test_world_shape(comm):
    assert hpctrain.size() == comm.size and hpctrain.rank() == comm.rank
    ranks = comm.allgather_object(comm.rank)
    assert ranks == list(range(comm.size))
    topo = comm.allgather_object((hpctrain.local_rank(), hpctrain.local_size(), hpctrain.node_rank()))
    # One machine is one node unless faked; on real (namespace) nodes the launch says how it placed ranks.
    k = int(os.environ.get("HPCTRAIN_RANKS_PER_NODE") or os.environ.get("HPCTRAIN_TEST_RANKS_PER_NODE")
            or comm.size)
    assert topo == [(r % k, min(k, comm.size - r // k * k), r // k) for r in range(comm.size)]
    assert hpctrain.num_nodes() == -(-comm.size // k)
    if "HPCTRAIN_RANKS_PER_NODE" not in os.environ:      # real nodes: node ranks follow the hostnames
        hosts = comm.allgather_object(socket.gethostname())
        assert [t[2] for t in topo] == [sorted(set(hosts), key=hosts.index).index(h) for h in hosts], hosts


def test_nodes_have_their_own_shared_memory_and_tmp(comm):
    """A rank sees the /dev/shm and /tmp files of the ranks on its own host, and no others."""
    tag = comm.broadcast_object(f"hpctrain-node-test-{os.getpid()}-{time.time_ns()}")
    hosts = comm.allgather_object(socket.gethostname())
    mine = [os.path.join(d, f"{tag}-{comm.rank}") for d in ("/dev/shm", "/tmp")]
    for path in mine:
        with open(path, "w") as f:
            f.write(hosts[comm.rank])
    try:
        comm.barrier()
        for d in ("/dev/shm", "/tmp"):
            seen = sorted(int(f.rsplit("-", 1)[1]) for f in os.listdir(d) if f.startswith(tag + "-"))
            assert seen == [r for r in range(comm.size) if hosts[r] == hosts[comm.rank]], (d, seen, hosts)
        comm.barrier()
    finally:
        for path in mine:
            os.unlink(path)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce(comm, dtype, op, size):
    n = comm.size
    count = {"0": 0, "1": 1, "n-1": n - 1}.get(size) if size != "1000003" else 1_000_003
    for alg in algorithms(comm):
        x = data(comm.rank, count, dtype, op)
        if not valid(dtype, op):
            with pytest.raises((TypeError, ValueError)):
                comm.allreduce(x, op=op, algorithm=alg)
            continue
        before = x.copy()
        out = comm.allreduce(x, op=op, algorithm=alg)
        expect = reference([data(r, count, dtype, op) for r in range(n)], op, n)
        assert out.dtype == x.dtype and out.shape == x.shape
        np.testing.assert_array_equal(out.astype(np.float64), expect.astype(np.float64), err_msg=alg)
        assert np.array_equal(x, before), "the input was modified"
        assert same_on_all_ranks(comm, out)


@pytest.mark.parametrize("shape", [(3, 5), (2, 0, 4), ()])
def test_allreduce_keeps_shape(comm, shape):
    for alg in algorithms(comm):
        x = np.full(shape, comm.rank + 1, dtype=np.float32)
        out = comm.allreduce(x, op="max", algorithm=alg)
        assert out.shape == shape
        np.testing.assert_array_equal(out, np.full(shape, comm.size, dtype=np.float32))


def test_allreduce_real_floats_bit_identical(comm):
    n = comm.size
    for alg in algorithms(comm):
        for dtype, rtol in ((np.float32, 1e-5), (np.float64, 1e-12), (np.float16, 2e-3), (BFLOAT16, 1e-2)):
            xs = [np.random.default_rng([7, r]).standard_normal(100_003).astype(dtype) for r in range(n)]
            out = comm.allreduce(xs[comm.rank], op="avg", algorithm=alg)
            expect = np.mean([x.astype(np.float64) for x in xs], axis=0)
            np.testing.assert_allclose(out.astype(np.float64), expect, rtol=rtol, atol=rtol)
            assert same_on_all_ranks(comm, out)
            again = comm.allreduce(xs[comm.rank], op="avg", algorithm=alg)
            assert again.tobytes() == out.tobytes(), "the same inputs must give the same bits"


def test_allreduce_64mib(comm):
    count = BIG // 4
    for alg in algorithms(comm):
        x = np.full(count, comm.rank + 1, dtype=np.float32)
        x[::4097] = -comm.rank
        out = comm.allreduce(x, algorithm=alg)
        expect = np.full(count, comm.size * (comm.size + 1) / 2, dtype=np.float32)
        expect[::4097] = -sum(range(comm.size))
        np.testing.assert_array_equal(out, expect)
        del out


def rows_of(rank, rows, dtype, width=3, seed=1):
    return data(rank, rows * width, dtype, seed=seed, shape=(rows, width))


@pytest.mark.parametrize("size", ["0", "1", "n-1", "1000003"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allgather(comm, dtype, size):
    n = comm.size
    base = {"0": 0, "1": 1, "n-1": n - 1}.get(size) if size != "1000003" else 1_000_003 // 3

    def count(r):  # dim 0 differs per rank
        return base + (r % 2 if base else 0)

    out = comm.allgather(rows_of(comm.rank, count(comm.rank), dtype))
    expect = np.concatenate([rows_of(r, count(r), dtype) for r in range(n)])
    assert out.dtype == np.dtype(dtype) and out.shape == expect.shape
    assert out.tobytes() == expect.tobytes()


def test_allgather_64mib(comm):
    per = (BIG // comm.size) // 8
    out = comm.allgather(np.full(per, comm.rank, dtype=np.int64))
    np.testing.assert_array_equal(out, np.repeat(np.arange(comm.size, dtype=np.int64), per))


@pytest.mark.parametrize("size", ["0", "1", "n-1", "1000003"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast(comm, dtype, size):
    n = comm.size
    count = {"0": 0, "1": 1, "n-1": n - 1}.get(size) if size != "1000003" else 1_000_003
    for root in range(n):
        x = data(comm.rank, count, dtype, seed=root)
        out = comm.broadcast(x, root=root)
        assert out.tobytes() == data(root, count, dtype, seed=root).tobytes()
        assert out.dtype == x.dtype and out.shape == x.shape


def test_broadcast_64mib(comm):
    for root in range(comm.size):
        x = np.full(BIG // 4, comm.rank, dtype=np.float32)
        out = comm.broadcast(x, root=root)
        assert np.all(out == root) and np.all(x == comm.rank)


@pytest.mark.parametrize("size", ["0", "1", "n-1", "1000003"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter(comm, dtype, op, size):
    n, r = comm.size, comm.rank
    rows = {"0": 0, "1": 1, "n-1": n - 1}.get(size) if size != "1000003" else 1_000_003 // 2
    for alg in algorithms(comm):
        x = data(r, rows * 2, dtype, op, shape=(rows, 2))
        if not valid(dtype, op):
            with pytest.raises((TypeError, ValueError)):
                comm.reduce_scatter(x, op=op, algorithm=alg)
            continue
        out = comm.reduce_scatter(x, op=op, algorithm=alg)
        full = reference([data(q, rows * 2, dtype, op, shape=(rows, 2)) for q in range(n)], op, n)
        b = segment_bounds(rows, n)
        assert out.shape == (b[r + 1] - b[r], 2) and out.dtype == x.dtype
        np.testing.assert_array_equal(out.astype(np.float64), full[b[r]:b[r + 1]].astype(np.float64))


def test_reduce_scatter_64mib(comm):
    rows = BIG // 4
    for alg in algorithms(comm):
        out = comm.reduce_scatter(np.full(rows, comm.rank + 1, dtype=np.float32), algorithm=alg)
        b = segment_bounds(rows, comm.size)
        assert out.shape == (b[comm.rank + 1] - b[comm.rank],)
        assert np.all(out == comm.size * (comm.size + 1) / 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alltoall(comm, dtype):
    n, r = comm.size, comm.rank
    # equal splits
    x = data(r, n * 2 * 3, dtype, seed=3, shape=(n * 2, 3))
    out = comm.alltoall(x)
    expect = np.concatenate([data(q, n * 2 * 3, dtype, seed=3, shape=(n * 2, 3))[2 * r:2 * r + 2] for q in range(n)])
    assert out.tobytes() == expect.tobytes()

    # uneven splits, including zero rows: rank q sends (q + i) % 3 rows to rank i
    def splits(q):
        return [(q + i) % 3 for i in range(n)]

    def rows(q):
        return data(q, sum(splits(q)) * 2, dtype, seed=4, shape=(sum(splits(q)), 2))

    out = comm.alltoall(rows(r), splits=splits(r))
    parts = []
    for q in range(n):
        off = sum(splits(q)[:r])
        parts.append(rows(q)[off:off + splits(q)[r]])
    assert out.tobytes() == np.concatenate(parts).tobytes()


def test_alltoall_64mib(comm):
    n = comm.size
    per = (BIG // 4) // n
    out = comm.alltoall(np.repeat(np.arange(n, dtype=np.float32) + 10 * comm.rank, per))
    np.testing.assert_array_equal(out, np.repeat(10 * np.arange(n, dtype=np.float32) + comm.rank, per))


def test_barrier_and_objects(comm):
    comm.barrier()
    for root in range(comm.size):
        got = comm.broadcast_object({"from": comm.rank, "list": [comm.rank] * 3}, root=root)
        assert got == {"from": root, "list": [root] * 3}
    assert comm.allgather_object(("r", comm.rank)) == [("r", q) for q in range(comm.size)]


def test_split(comm):
    n, r = comm.size, comm.rank
    members = [q for q in range(n) if q % 2 == r % 2]
    if comm.backend == "horovod":  # process sets keep world order; other orders are refused
        if n >= 3:  # some group has two members: every rank gets the error
            with pytest.raises(ValueError, match="order"):
                comm.split(color=r % 2, key=-r)
        sub = comm.split(color=r % 2, key=r)
        assert sub.world_ranks == tuple(members)
    else:
        sub = comm.split(color=r % 2, key=-r)  # reverse order inside each group
        assert sub.world_ranks == tuple(sorted(members, reverse=True))
    assert sub.size == len(members) and sub.world_ranks[sub.rank] == r
    out = sub.allreduce(np.array([r, 1], dtype=np.int64))
    np.testing.assert_array_equal(out, [sum(members), len(members)])
    assert sub.allgather(np.array([r])).tolist() == list(sub.world_ranks)
    got = sub.broadcast(np.array([r]), root=sub.size - 1)
    assert got[0] == sub.world_ranks[-1]
    none = comm.split(color=None if r == 0 else 1)
    assert (none is None) == (r == 0)
    if none is not None:
        assert none.size == n - 1
        assert none.allreduce(np.ones(1))[0] == n - 1


def test_async_handles(comm):
    n = comm.size
    xs = [np.full(50_000, i + comm.rank, dtype=np.float64) for i in range(6)]
    handles = [comm.allreduce_async(x) for x in xs]
    g = comm.allgather_async(np.array([comm.rank]))
    b = comm.broadcast_async(np.array([comm.rank]), root=n - 1)
    for i in reversed(range(6)):  # any wait order
        np.testing.assert_array_equal(handles[i].wait(), np.full(50_000, n * i + n * (n - 1) / 2))
        assert handles[i].test()
    assert g.wait().tolist() == list(range(n))
    assert b.wait()[0] == n - 1
    # a synchronous call after asynchronous ones runs after them
    h = comm.allreduce_async(np.ones(10))
    out = comm.allreduce(np.full(10, 2.0))
    assert h.test() and h.wait()[0] == n and out[0] == 2 * n
    assert comm.barrier_async().wait() is None
    assert comm.allgather_object_async(comm.rank).wait() == list(range(n))
    assert comm.broadcast_object_async(comm.rank, root=0).wait() == 0
    assert comm.reduce_scatter_async(np.ones(n)).wait().tolist() == [float(n)]
    assert comm.alltoall_async(np.arange(n)).wait().tolist() == [comm.rank] * n


def test_facade_functions(comm):
    n = comm.size
    assert hpctrain.allreduce(np.ones(3), op="avg").tolist() == [1.0] * 3
    assert hpctrain.allgather(np.array([comm.rank])).tolist() == list(range(n))
    assert hpctrain.broadcast(np.array([comm.rank]), root=0)[0] == 0
    assert hpctrain.allreduce_async(np.ones(2)).wait().tolist() == [n, n]
    hpctrain.barrier()


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


def test_ring_unavailable_on_horovod(comm):
    if comm.backend != "horovod":
        assert "ring" in comm.allreduce_algorithms()
        return
    with pytest.raises(ValueError, match="algorithm"):
        comm.allreduce(np.ones(3), algorithm="ring")


def test_window_of_many_calls_in_flight(comm):
    """Many async calls of changing sizes complete in order with correct results."""
    n = comm.size
    sizes = [0, 1, 7, 1000, 65_537, 3, 300_001]
    handles = [(s, comm.allreduce_async(np.full(s, comm.rank + 1.0, dtype=np.float32))) for s in sizes * 3]
    for s, h in handles:
        out = h.wait()
        assert out.shape == (s,) and np.all(out == n * (n + 1) / 2)


@pytest.mark.parametrize("algorithm", ["auto", "ring", "shm"])
def test_allreduce_inplace_writes_into_the_input(comm, algorithm):
    import torch

    if algorithm != "auto" and algorithm not in algorithms(comm):
        pytest.skip(f"no {algorithm} algorithm on the {comm.backend} backend with this layout")
    n, r = comm.size, comm.rank
    a = np.arange(1001, dtype=np.float32) + r
    out = comm.allreduce(a, inplace=True, algorithm=algorithm)
    assert out is a
    np.testing.assert_array_equal(a, n * np.arange(1001, dtype=np.float32) + n * (n - 1) / 2)
    t = torch.full((4, 3), float(r + 1)).t()               # not contiguous: written back by copy
    assert comm.allreduce_async(t, op="avg", inplace=True, algorithm=algorithm).wait() is t
    assert torch.all(t == (n + 1) / 2)
    h = torch.full((5,), float(r + 1), dtype=torch.float16)  # accumulated in float32, copied back
    comm.allreduce(h, inplace=True, algorithm=algorithm)
    assert torch.all(h == n * (n + 1) / 2)
    if n > 1:
        with pytest.raises(hpctrain.CollectiveMismatchError, match="writable C-contiguous"):
            comm.allreduce(np.ones(6)[::2], inplace=True)


def test_shm_refused_across_nodes(comm):
    if "shm" not in comm.allreduce_algorithms() or comm.topology.num_nodes == 1:
        pytest.skip("needs the MPI backend on several (HPCTRAIN_RANKS_PER_NODE) nodes")
    with pytest.raises(hpctrain.CollectiveMismatchError, match="algorithm='shm' needs every rank"):
        comm.allreduce(np.ones(5), algorithm="shm")
    comm.allreduce(np.ones(5), algorithm="hierarchical")     # still in step afterwards


def test_shared_memory_reduces_in_rank_order(comm):
    """On one node, shm gives exactly ((x_0 + x_1) + x_2) + ... for real floats, whatever the size."""
    if "shm" not in algorithms(comm):
        pytest.skip("shm needs the MPI backend on one node")
    n = comm.size
    for count in (1, 1000, 100_003):
        xs = [np.random.default_rng([11, r, count]).standard_normal(count).astype(np.float32) for r in range(n)]
        expect = xs[0].copy()
        for x in xs[1:]:
            expect += x
        assert comm.allreduce(xs[comm.rank], algorithm="shm").tobytes() == expect.tobytes()


def summed(n, count, dtype, shape=None):
    """:func:`reference`'s exact sum of every rank's :func:`data`, one input at a time (no stack of n copies)."""
    total = data(0, count, dtype, shape=shape)
    for r in range(1, n):
        total += data(r, count, dtype, shape=shape)
    return total


def test_shared_memory_arena_reused_across_changing_sizes(comm):
    """Sizes that grow and shrink (the arena is reallocated, then reused) keep giving exact results."""
    n = comm.size
    sums = {}               # (count, dtype) -> the sum over ranks, made once for both algorithms and repeats
    for alg in [a for a in algorithms(comm) if a in ("shm", "hierarchical")]:
        for count in [10, 5_000_000, 3, 70_000, 5_000_000, 1, 300_001, 12_000_000, 17]:
            x = data(comm.rank, count, np.float32)
            if (count, "f4") not in sums:
                sums[count, "f4"] = summed(n, count, np.float32)
            np.testing.assert_array_equal(comm.allreduce(x, algorithm=alg), sums[count, "f4"])
            rows = max(1, count // 3)
            y = data(comm.rank, rows * 3, np.float64, shape=(rows, 3))
            if (count, "f8") not in sums:
                sums[count, "f8"] = np.array_split(summed(n, rows * 3, np.float64, shape=(rows, 3)), n)[comm.rank]
            np.testing.assert_array_equal(comm.reduce_scatter(y, algorithm=alg), sums[count, "f8"])


def group_of(rank, seed=0):
    """A gradient-like list: mixed sizes (some empty, some over a fusion buffer), dtypes and shapes."""
    specs = [((3, 4), np.float32), ((0,), np.float32), ((1000,), np.float16), ((7,), np.int64),
             ((300_000,), np.float32), ((2, 3, 5), np.float64), ((1,), np.float32), ((40_000, 10), np.float32),
             ((5,), BFLOAT16), ((2,), np.float16)]
    out = []
    for i, (shape, dtype) in enumerate(specs):
        count = int(np.prod(shape))
        out.append(data(rank, count, dtype, seed=seed + i, shape=shape))
    return out


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_grouped_allreduce_equals_one_allreduce_per_tensor(comm, op):
    n = comm.size
    for alg in algorithms(comm):
        xs = [x for x in group_of(comm.rank) if valid(x.dtype, op)]
        got = comm.grouped_allreduce(xs, op=op, algorithm=alg)
        assert len(got) == len(xs)
        for i, (g, x) in enumerate(zip(got, xs)):
            expect = reference([x2 for x2 in (
                [y for y in group_of(r) if valid(y.dtype, op)][i] for r in range(n))], op, n)
            assert g.dtype == x.dtype and g.shape == x.shape, (alg, i)
            np.testing.assert_array_equal(g, expect, err_msg=f"{alg} tensor {i}")
            single = comm.allreduce(x, op=op, algorithm=alg)
            assert single.tobytes() == g.tobytes(), f"fused and unfused differ: {alg} tensor {i}"
        assert same_on_all_ranks(comm, np.concatenate([g.reshape(-1).astype(np.float64) for g in got]))


def test_grouped_allreduce_real_floats_bit_identical_to_unfused_on_shared_memory(comm):
    n = comm.size
    for alg in [a for a in algorithms(comm) if a in ("shm", "hierarchical")]:
        xs = [np.random.default_rng([5, comm.rank, i]).standard_normal(s).astype(np.float32)
              for i, s in enumerate([10, 100_000, 3, 250_000, 1])]
        got = comm.grouped_allreduce(xs, op="avg", algorithm=alg)
        if comm.topology.num_nodes <= 2:      # across more nodes the ring's order follows the segments
            for g, x in zip(got, xs):
                assert g.tobytes() == comm.allreduce(x, op="avg", algorithm=alg).tobytes(), alg
        assert same_on_all_ranks(comm, np.concatenate(got))
        assert n == 1 or not np.array_equal(got[1], xs[1])


def test_grouped_allreduce_async_inplace_and_torch(comm):
    import torch

    n, r = comm.size, comm.rank
    ts = [torch.full((3, 2), float(r + 1)), torch.arange(5, dtype=torch.float64) * (r + 1),
          torch.ones(4, dtype=torch.float16)]
    handle = comm.grouped_allreduce_async(ts, op="sum", inplace=True)
    out = handle.wait()
    assert all(o is t for o, t in zip(out, ts))
    assert torch.all(ts[0] == n * (n + 1) / 2)
    assert torch.equal(ts[1], torch.arange(5, dtype=torch.float64) * (n * (n + 1) / 2))
    assert torch.all(ts[2] == n)
    fresh = hpctrain.grouped_allreduce([np.full(2, r, dtype=np.int32)], op="max")
    assert fresh[0].tolist() == [n - 1, n - 1]
    assert comm.grouped_allreduce([]) == []


def test_grouped_allreduce_mismatch_inside_the_group_is_reported(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    xs = [np.ones(4, np.float32), np.ones((3, 3) if comm.rank == 1 else (9,), np.float32)]
    with pytest.raises(hpctrain.CollectiveMismatchError, match=r"grouped_allreduce[\s\S]*rank 1"):
        comm.grouped_allreduce(xs)
    fewer = [np.ones(4, np.float32)] * (1 if comm.rank == 0 else 2)
    with pytest.raises(hpctrain.CollectiveMismatchError, match="tensors"):
        comm.grouped_allreduce(fewer)
    assert comm.grouped_allreduce([np.ones(2)])[0].tolist() == [comm.size] * 2
    same = [np.ones(4, np.float32), np.ones(9, np.float32)]
    for _ in range(2):                          # a list repeated (its plan is reused), then changed on rank 1
        assert [o.tolist() for o in comm.grouped_allreduce(same)] == [[comm.size] * 4, [comm.size] * 9]
    changed = same if comm.rank != 1 else [same[0], np.ones(9, np.float64)]
    with pytest.raises(hpctrain.CollectiveMismatchError, match=r"grouped_allreduce[\s\S]*rank 1"):
        comm.grouped_allreduce(changed)
    with pytest.raises(hpctrain.CollectiveMismatchError, match="op=max"):
        comm.grouped_allreduce(same, op="max" if comm.rank == 0 else "sum")


def test_shared_memory_in_place_over_several_pieces(comm):
    """In place, each piece of the arena reads its input before writing the result into the same memory."""
    n = comm.size
    for alg in [a for a in algorithms(comm) if a in ("shm", "hierarchical")]:
        count = 3 * comm.config.shm_min_bytes + 12_345_679        # several arena pieces with the defaults too
        x = data(comm.rank, count, np.float32)
        expect = reference([data(r, count, np.float32) for r in range(n)], "sum", n)
        assert comm.allreduce(x, algorithm=alg, inplace=True) is x
        np.testing.assert_array_equal(x, expect)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_shared_buffer_reduces_in_place_with_the_bits_of_the_arena_path(comm, op):
    """A buffer from shared_empty: in-place all-reduce without the arena, same bits as the ordinary path.

    Sizes include 0, 1, fewer elements than ranks, and one that does not
    divide; float64 too; the buffer is reused across calls (as an
    optimizer's bucket is).
    """
    n, r = comm.size, comm.rank
    for dtype in (np.float32, np.float64):
        for count in (0, 1, max(1, n - 1), 100_003):
            buf = comm.shared_empty(count, dtype)
            assert buf.shape == (count,) and buf.dtype == dtype
            for call in range(2):
                x = np.random.default_rng([5, r, count, call]).standard_normal(count).astype(dtype)
                buf[...] = x
                plain = comm.allreduce(x, op=op)             # the ordinary path, copy in and out
                assert comm.allreduce(buf, op=op, inplace=True) is buf
                assert buf.tobytes() == plain.tobytes(), f"{dtype.__name__}[{count}] call {call}"
                exact = data(r, count, dtype, op)
                buf[...] = exact
                comm.allreduce_async(buf, op=op, inplace=True).wait()
                np.testing.assert_array_equal(buf, reference([data(k, count, dtype, op) for k in range(n)], op, n))
    assert same_on_all_ranks(comm, buf)


def test_shared_buffer_as_torch_tensor_and_mismatch_with_a_plain_buffer(comm):
    import torch

    n, r = comm.size, comm.rank
    t = torch.from_numpy(comm.shared_empty(1000, np.float32))
    t.fill_(r + 1)
    comm.allreduce(t, op="avg", inplace=True)
    assert torch.all(t == (n + 1) / 2)
    buf = comm.shared_empty(64, np.float32)
    if n > 1 and "shm" in comm.allreduce_algorithms():
        x = buf if r == 0 else np.zeros(64, np.float32)      # rank 0 alone passes its shared buffer
        with pytest.raises(hpctrain.CollectiveMismatchError, match="shared buffer"):
            comm.allreduce(x, inplace=True, algorithm="hierarchical" if comm.topology.num_nodes > 1 else "shm")
    with pytest.raises(hpctrain.CollectiveMismatchError if n > 1 else ValueError, match="count must be"):
        comm.shared_empty(-1)


def test_large_results_held_by_the_caller_stay_intact(comm):
    """Large results come from a pool reused across calls; results still held are never written again."""
    n = comm.size
    for alg in algorithms(comm):
        held = [comm.allreduce(np.full(300_001, float(comm.rank + i), np.float32), algorithm=alg)
                for i in range(4)]                                   # 1.2 MB each, over the pool's 1 MiB
        for i, out in enumerate(held):
            np.testing.assert_array_equal(out, np.full(300_001, sum(r + i for r in range(n)), np.float32))
        del held
        for i in range(3):                                           # dropped results' memory is reused
            out = comm.allreduce(np.full(300_001, float(i), np.float32), algorithm=alg)
            np.testing.assert_array_equal(out, np.full(300_001, float(i * n), np.float32))


def test_grouped_results_held_by_the_caller_stay_intact(comm):
    """A fused group's results share one pooled buffer: one small result still held keeps all of it from reuse."""
    n = comm.size
    for alg in algorithms(comm):
        kept = []
        for i in range(4):
            outs = comm.grouped_allreduce([np.full(3, float(comm.rank + i), np.float32),
                                           np.full(400_000, float(i), np.float32)], algorithm=alg)
            kept.append(outs[0])                                     # drop the large one, keep the small one
            np.testing.assert_array_equal(outs[1], np.full(400_000, float(i * n), np.float32))
            del outs
        for i, out in enumerate(kept):
            np.testing.assert_array_equal(out, np.full(3, float(sum(r + i for r in range(n))), np.float32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_], ids=str)
def test_repeated_small_allreduce_takes_the_lean_path_with_the_same_results(comm, dtype):
    """A repeated small call (the lean path on one node) gives the reference, the same bits as the first call."""
    n = comm.size
    for op in OPS:
        if not valid(dtype, op):
            continue
        for shape in [(7, 3), ()]:
            count = int(np.prod(shape))
            expect = reference([data(r, count, dtype, op, shape=shape) for r in range(n)], op, n)
            first = None
            for call in range(4):              # the first call plans and checks; the others reuse it
                x = data(comm.rank, count, dtype, op, shape=shape)
                out = comm.allreduce(x, op=op)
                assert type(out) is np.ndarray and out.dtype == x.dtype and out.shape == shape
                np.testing.assert_array_equal(out.astype(np.float64), expect.astype(np.float64))
                first = out.tobytes() if first is None else first
                assert out.tobytes() == first
            assert same_on_all_ranks(comm, out)
            if lean_expected(comm):    # (the path under test ran)
                assert (np.ndarray, x.dtype, x.shape, "allreduce", op, "auto", False) in comm._reductions.lean


def lean_expected(comm):
    """Whether repeated small all-reduces of ``comm`` take the lean path (MPI on one node, or one rank)."""
    return comm.size == 1 or getattr(comm, "_mailbox", None) is not None


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.float16], ids=str)
def test_repeated_small_inplace_allreduce_writes_into_the_input(comm, dtype):
    """In place, repeated (the lean path after the first call): the reduction lands in the caller's array,
    through ``auto`` and through ``native`` (the call check, then the library's call)."""
    n = comm.size
    for op, algorithm in itertools.product(OPS, ("auto", "native")):
        if not valid(dtype, op):
            continue
        for shape in [(5, 3), ()]:
            x = np.empty(shape, dtype)
            count = int(np.prod(shape))
            for call in range(4):
                xs = [data(r, count, dtype, op, seed=call, shape=shape) for r in range(n)]
                x[...] = xs[comm.rank]
                assert comm.allreduce(x, op=op, inplace=True, algorithm=algorithm) is x
                assert x.tobytes() == reference(xs, op, n).tobytes()
            if lean_expected(comm) and dtype != np.float16:       # (float16 widens: planned each time)
                assert (np.ndarray, x.dtype, x.shape, "allreduce", op, algorithm, True) in comm._reductions.lean
    frozen = np.ones(4, dtype)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):         # (the lean path refuses it; planning explains)
        comm.allreduce(frozen, inplace=True)


def test_repeated_small_torch_allreduce_in_place_and_out(comm):
    """torch CPU tensors on the lean path: in place (a plain tensor, one that requires grad, one whose memory
    moved between calls), out of place, and a non-contiguous tensor (planned each time) all give the reference."""
    import torch
    n = comm.size
    t = torch.zeros(6, 4)
    p = torch.zeros(6, 4, requires_grad=True)
    for op in ("sum", "avg", "max"):
        for call in range(4):
            xs = [data(r, 24, np.float32, op, seed=call, shape=(6, 4)) for r in range(n)]
            expect = reference(xs, op, n)
            if call == 2:
                t.data = torch.zeros(6, 4)                # new memory for the same tensor object
            t.copy_(torch.from_numpy(xs[comm.rank]))
            assert comm.allreduce(t, op=op, inplace=True) is t
            np.testing.assert_array_equal(t.numpy(), expect)
            with torch.no_grad():
                p.copy_(torch.from_numpy(xs[comm.rank]))
            assert comm.allreduce(p, op=op, inplace=True) is p
            np.testing.assert_array_equal(p.detach().numpy(), expect)
            out = comm.allreduce(torch.from_numpy(xs[comm.rank]), op=op)
            assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
            np.testing.assert_array_equal(out.numpy(), expect)
            strided = torch.zeros(6, 8)[:, ::2]
            strided.copy_(torch.from_numpy(xs[comm.rank]))
            assert comm.allreduce(strided, op=op, inplace=True) is strided
            np.testing.assert_array_equal(strided.numpy(), expect)
    if lean_expected(comm):
        assert (torch.Tensor, torch.float32, (6, 4), "allreduce", "max", "auto", True) in comm._reductions.lean
    with pytest.raises((TypeError, hpctrain.CollectiveMismatchError), match="sparse"):   # (same key, refused)
        comm.allreduce(torch.zeros(6, 4).to_sparse(), op="max", inplace=True)


def test_repeated_small_allreduce_waits_for_the_async_calls_before_it(comm):
    """A lean call after asynchronous ones runs after them, on every rank (else ranks would pair different calls)."""
    n = comm.size
    x = np.ones(8, np.float32)
    comm.allreduce(x, inplace=True)                  # (planned: the next ones are lean)
    for i in range(5):
        handles = [comm.allreduce_async(np.full(3000 * (k + 1), float(k + i), np.float32)) for k in range(3)]
        x[...] = comm.rank + i
        comm.allreduce(x, inplace=True)
        np.testing.assert_array_equal(x, np.full(8, sum(r + i for r in range(n)), np.float32))
        for k, h in enumerate(handles):
            np.testing.assert_array_equal(h.wait(), np.full(3000 * (k + 1), float((k + i) * n), np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float16], ids=str)
def test_repeated_small_reduce_scatter_gives_each_rank_its_block(comm, dtype):
    """Small reduce-scatters (on one node they ride the call check) and a large one, against numpy's blocks."""
    n, r = comm.size, comm.rank
    for op in ("sum", "avg", "max"):
        if not valid(dtype, op):
            continue
        for rows in (2 * n + 1, 3, 90_001):
            bounds = segment_bounds(rows, n)
            for call in range(3):
                xs = [data(k, rows * 3, dtype, op, seed=call, shape=(rows, 3)) for k in range(n)]
                out = comm.reduce_scatter(xs[r], op=op)
                expect = reference(xs, op, n)[bounds[r]:bounds[r + 1]]
                assert out.dtype == dtype and out.shape == expect.shape
                assert out.tobytes() == expect.tobytes()


def test_repeated_small_allgather_with_uneven_and_oversized_inputs(comm):
    """Allgathers whose byte counts ride the call check: uneven first dimensions, small inputs (their bytes
    ride too), one rank's input too large to ride (every rank then gathers through MPI), ``native``, and
    rows of no bytes; all against numpy's concatenation."""
    n, r = comm.size, comm.rank
    capacity = comm._mailbox.capacity if getattr(comm, "_mailbox", None) is not None else 1 << 16
    cases = [lambda k: (k + 1, 5), lambda k: (0 if k == 1 else 2, 5),
             lambda k: (capacity // 20 + 1 if k == 0 else 1, 5), lambda k: (k, 0)]
    for case, shape_of in enumerate(cases):
        for algorithm in ("auto", "native"):
            for call in range(3):
                xs = [data(k, int(np.prod(shape_of(k))), np.float32, seed=call, shape=shape_of(k)) for k in range(n)]
                out = comm.allgather(xs[r], algorithm=algorithm)
                expect = np.concatenate(xs)
                assert out.shape == expect.shape, (case, algorithm)
                assert out.tobytes() == expect.tobytes(), (case, algorithm)
    for dtype in [np.float16, np.int8, np.bool_] + ([BFLOAT16] if BFLOAT16 is not None else []):
        for call in range(3):
            xs = [data(k, (k + 2) * 3, dtype, seed=call, shape=(k + 2, 3)) for k in range(n)]
            out = comm.allgather(xs[r])
            assert out.dtype == dtype and out.tobytes() == np.concatenate(xs).tobytes()


def uses_c_kernel(comm, x, op):
    """Whether the repeated all-reduce of ``x`` by ``op`` runs in the mailbox's C kernel."""
    mb = getattr(comm, "_mailbox", None)
    return mb is not None and mb.sum_code(x.dtype, op) is not None


def ordered_sum(inputs, op, n):
    """x_0 + x_1 + ... added left to right in numpy (then / n for avg): the order every algorithm keeps."""
    out = inputs[0].copy()
    for x in inputs[1:]:
        out = np.add(out, x)
    return out / out.dtype.type(n) if op == "avg" else out


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_repeated_small_sum_rounds_as_additions_in_rank_order(comm, dtype):
    """Inexact sums: the first (general) call and the repeated (lean, C kernel) ones equal the rank-order sum.

    On one node, that is; across nodes each node's sum is added in rank order
    and the node sums in the ring's order, so there the result is only close
    (and equal on every rank).
    """
    n, one_node = comm.size, getattr(comm, "_mailbox", None) is not None or comm.size == 1

    def inputs(r, call):
        rng = np.random.default_rng([11, r, call])
        return (rng.standard_normal((33, 5)) * 10.0 ** rng.integers(-7, 8, (33, 5))).astype(dtype)
    for op in ("sum", "avg"):
        for call in range(4):
            xs = [inputs(r, call) for r in range(n)]
            expect = ordered_sum(xs, op, n)
            if n >= 3 and call == 0:        # (the data tells orders apart: a wrong order would fail)
                assert not np.array_equal(expect, ordered_sum(xs[::-1], op, n))
            out = comm.allreduce(xs[comm.rank], op=op)
            assert out.dtype == dtype
            if one_node:
                assert out.tobytes() == expect.tobytes()
            else:
                bound = n * np.finfo(dtype).eps * np.abs(np.stack(xs)).sum(axis=0)    # rounding of n adds
                assert np.all(np.abs(out - expect) <= bound)
                assert same_on_all_ranks(comm, out)
    if getattr(comm, "_mailbox", None) is not None and comm._mailbox._kernel is not None:
        assert uses_c_kernel(comm, xs[0], "sum")


@pytest.mark.parametrize("dtype", [np.int32, np.int64], ids=str)
def test_repeated_small_integer_sum_wraps_around_as_numpy_does(comm, dtype):
    n, info = comm.size, np.iinfo(dtype)
    xs = [np.array([info.max - r, info.min + r, r - 3, info.max // 2], dtype) for r in range(n)]
    expect = ordered_sum(xs, "sum", n)
    for _ in range(3):
        assert comm.allreduce(xs[comm.rank]).tobytes() == expect.tobytes()


def test_repeated_small_sums_agree_when_some_ranks_lack_the_c_kernel(comm):
    """The C kernel and the Python exchange keep one protocol: ranks on either path meet and agree bit for bit."""
    if getattr(comm, "_mailbox", None) is None or comm._mailbox._kernel is None:
        pytest.skip("needs the MPI backend on one node with the C kernel built")
    sub = comm.split(0)                      # a fresh communicator: no call of it planned yet
    try:
        if sub.rank % 2:
            sub._mailbox._kernel = None      # odd ranks exchange and reduce in Python
        x = np.random.default_rng([5, sub.rank]).standard_normal(300).astype(np.float32)
        xs = [np.random.default_rng([5, r]).standard_normal(300).astype(np.float32) for r in range(sub.size)]
        for _ in range(4):
            out = sub.allreduce(x)
            assert out.tobytes() == ordered_sum(xs, "sum", sub.size).tobytes()
            assert same_on_all_ranks(comm, out)
        assert uses_c_kernel(sub, x, "sum") == (sub.rank % 2 == 0)
        if sub.size == 1:
            return
        with pytest.raises(hpctrain.CollectiveMismatchError, match="op=max"):
            sub.allreduce(x, op="max" if sub.rank == 0 else "sum")
    finally:
        sub.free()


def test_mismatch_after_a_repeated_small_allreduce_is_reported_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    x = np.ones(16, np.float32)
    for _ in range(3):
        assert comm.allreduce(x).tolist() == [comm.size] * 16
    # rank 1 changes its shape; the others repeat the call they made before (the lean path)
    y = np.ones(17 if comm.rank == 1 else 16, np.float32)
    with pytest.raises(hpctrain.CollectiveMismatchError, match=r"rank 1[^\n]*float32\[17\]"):
        comm.allreduce(y)
    with pytest.raises(hpctrain.CollectiveMismatchError, match="op=max"):
        comm.allreduce(x, op="max" if comm.rank == 0 else "sum")
    assert comm.allreduce(x).tolist() == [comm.size] * 16


def direct_copies_expected(comm):
    """Whether large one-node all-reduces of ``comm`` should copy straight between ranks' memory.

    The MPI backend on one node with more than one rank, unless HPCTRAIN_CROSS_MEMORY=0:
    this machine's kernel allows process_vm_readv between one user's processes.
    """
    return (comm.backend == "mpi" and comm.size > 1 and comm.topology.num_nodes == 1
            and not getattr(comm, "_no_windows", "") and os.environ.get("HPCTRAIN_CROSS_MEMORY") != "0")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64], ids=str)
def test_large_allreduce_copying_between_ranks_rounds_in_rank_order(comm, dtype):
    """Large one-node all-reduces (the direct copies between ranks): rank-order bits, in place, out of place, fused.

    Several blocks per segment with a short last one, a fused group whose
    tensors straddle the blocks and segments, inexact floats (so a wrong
    order shows); on one node with the MPI backend the bits equal numpy's left-to-right sum, and
    across fake nodes (the hierarchical form) the result is within
    ``n eps sum|x|`` and the same on every rank.
    """
    from hpctrain.comm.mpi.direct import DIRECT_MIN_BYTES_OVERSUBSCRIBED as most     # (both thresholds)
    n, itemsize = comm.size, np.dtype(dtype).itemsize
    count = 3 * most // (2 * itemsize) + 7

    def inputs(seed, size):
        rng = np.random.default_rng([seed, size])
        if np.dtype(dtype).kind == "i":
            return [rng.integers(-2**40, 2**40, size).astype(dtype) for _ in range(n)]
        scale = 10.0 ** np.arange(-6, 7)           # 10**k for k in [-6, 7), looked up instead of 6M pows
        return [(rng.standard_normal(size) * scale[rng.integers(-6, 7, size) + 6]).astype(dtype) for _ in range(n)]

    def check(out, xs, op):
        expect = (np.maximum.reduce(xs) if op == "max" else ordered_sum(xs, op, n)) if n > 1 else xs[0]
        assert out.dtype == expect.dtype and out.shape == expect.shape
        # rank order is hpctrain's own (MPI backend, one node); Horovod sums in an order of its own
        exact_order = comm.backend == "mpi" and comm.topology.num_nodes == 1
        if exact_order or op == "max" or np.dtype(dtype).kind == "i":
            assert out.tobytes() == expect.tobytes()
        else:
            bound = n * np.finfo(dtype).eps * np.sum(np.abs(np.stack(xs)), axis=0) * (1 / n if op == "avg" else 1)
            assert np.all(np.abs(out.astype(np.float64) - expect) <= bound)
        assert same_on_all_ranks(comm, out)

    ops = ["sum", "max"] + (["avg"] if np.dtype(dtype).kind == "f" else [])
    # (on one node, named: `auto` may measure the library faster here, and its sums go in an order of its own)
    alg = "shm" if comm.backend == "mpi" and comm.topology.num_nodes == 1 and n > 1 else "auto"
    xs = inputs(1, count)                    # (no call below writes into them)
    for op in ops:
        check(comm.allreduce(xs[comm.rank], op=op, algorithm=alg), xs, op)
        y = xs[comm.rank].copy()
        out = comm.allreduce(y, op=op, inplace=True, algorithm=alg)
        check(y, xs, op)
        assert out is y or np.shares_memory(out, y)
    sizes = [5, count // 3, 1, count // 2 + 11, 3]          # one group: tensors across blocks and segments
    parts = [inputs(10 + i, s) for i, s in enumerate(sizes)]
    outs = comm.grouped_allreduce([p[comm.rank] for p in parts], op="sum", algorithm=alg)
    for out, p in zip(outs, parts):
        check(out, p, "sum")
    if np.dtype(dtype).kind == "f":           # the group in place: the average written back into each tensor
        ys = [p[comm.rank].copy() for p in parts]
        outs = comm.grouped_allreduce(ys, op="avg", inplace=True, algorithm=alg)
        for out, y, p in zip(outs, ys, parts):
            assert out is y or np.shares_memory(out, y)
            check(y, p, "avg")
    if comm.backend == "mpi" and n > 1 and comm.topology.num_nodes == 1:
        assert bool(comm._direct.usable) == direct_copies_expected(comm)


def test_large_allreduce_uses_the_arena_on_every_rank_when_one_rank_turns_direct_copies_off(comm):
    """HPCTRAIN_CROSS_MEMORY=0 on one rank (rank 0) makes every rank use the arena: they still meet and agree."""
    import dataclasses

    if not direct_copies_expected(comm):
        pytest.skip("needs the MPI backend on one node, several ranks, with direct copies on")
    from hpctrain.comm.mpi.direct import DIRECT_MIN_BYTES_OVERSUBSCRIBED as most
    sub = comm.split(0)                      # a fresh communicator: not probed yet
    config = sub._rt.config
    try:
        if sub.rank == 0:
            sub._rt.config = dataclasses.replace(config, cross_memory=False)
        xs = [np.random.default_rng([7, r]).standard_normal(most // 4 + 3).astype(np.float32)
              for r in range(sub.size)]
        out = sub.allreduce(xs[sub.rank])
        sub._rt.config = config
        assert sub._direct.usable is False
        assert out.tobytes() == ordered_sum(xs, "sum", sub.size).tobytes()
        assert same_on_all_ranks(comm, out)
    finally:
        sub._rt.config = config
        sub.free()


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint16])
def test_narrow_integers(comm, dtype):
    """int8, int16 and uint16 (one test each, not the whole dtype sweep): reductions, gather, broadcast against numpy."""
    n, r = comm.size, comm.rank
    xs = [((np.arange(12) * (q + 3)) % 23 - (11 if np.dtype(dtype).kind == "i" else 0)).astype(dtype) for q in range(n)]
    stack = np.stack(xs)
    np.testing.assert_array_equal(comm.allreduce(xs[r]), stack.sum(0, dtype=dtype))
    np.testing.assert_array_equal(comm.allreduce(xs[r], op="min"), stack.min(0))
    np.testing.assert_array_equal(comm.allreduce(xs[r], op="max"), stack.max(0))
    np.testing.assert_array_equal(comm.allgather(xs[r]), np.concatenate(xs))
    np.testing.assert_array_equal(comm.broadcast(xs[r], root=n - 1), xs[n - 1])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16])
def test_narrow_integer_sums_wrap_around_on_every_algorithm(comm, dtype):
    """Sums past the dtype's range wrap around as numpy's do, on every algorithm, in all-reduce and
    reduce-scatter (Open MPI's AVX reductions saturate them instead: the native path must not)."""
    n, r = comm.size, comm.rank
    info = np.iinfo(dtype)
    xs = [np.full(4 * n * 1000, info.max - q, dtype=dtype) for q in range(n)]
    xs[0][::3] = info.min
    want = np.stack(xs).sum(0, dtype=dtype)
    exact = np.stack(xs).astype(np.int64).sum(0)
    assert n == 1 or np.any(want != exact), "the sums must overflow for this test to mean anything"
    for alg in algorithms(comm):
        np.testing.assert_array_equal(comm.allreduce(xs[r], algorithm=alg), want, err_msg=alg)
        mine = comm.reduce_scatter(xs[r], algorithm=alg)
        np.testing.assert_array_equal(mine, np.array_split(want, n)[r], err_msg=f"reduce_scatter {alg}")


def test_comm_log_counts_bytes_and_bandwidths_of_every_call(comm):
    """The communication log: per collective and size bucket, the calls this test made, their bytes (the
    input's; all-gather's output), and busbw = algbw x nccl-tests' factor for this many ranks."""
    n = comm.size
    log = comm.comm_log
    was_on = log.on
    log.clear()
    log.start()
    try:
        for _ in range(3):
            comm.allreduce(np.ones(1000, np.float32))            # 4000 B: the 4 KiB bucket
        comm.allreduce(np.ones(300_000, np.float64), op="avg")   # 2.4 MB: the 4 MiB bucket
        comm.allgather(np.ones((2, 5), np.int32))                # 40 B per rank, 40 n gathered
        comm.broadcast(np.ones(7), root=0)
        comm.barrier()
    finally:
        if not was_on:
            log.stop()
    rows = {(r["collective"], r["bucket_bytes"]): r for r in log.rows()}
    log.clear()
    gathered = 40 * n
    expect = {("allreduce", 4096): (3, 12000), ("allreduce", 4 << 20): (1, 2_400_000),
              ("allgather", 1 << (gathered - 1).bit_length()): (1, gathered), ("broadcast", 64): (1, 56),
              ("barrier", 0): (1, 0)}
    assert set(rows) == set(expect), sorted(rows)
    factors = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "broadcast": 1.0}
    for key, (count, nbytes) in expect.items():
        r = rows[key]
        assert (r["count"], r["bytes"], r["ranks"]) == (count, nbytes, n), r
        assert r["mean_latency_s"] > 0
        assert r["algbw_gbps"] == pytest.approx(nbytes / (r["mean_latency_s"] * count) / 1e9)
        if key[0] in factors:
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factors[key[0]])
        else:
            assert r["busbw_gbps"] is None


def test_auto_measures_mid_size_calls_on_their_first_uses_and_every_rank_keeps_the_same_way(comm):
    """With the default HPCTRAIN_SHM_MIN_BYTES (0), the first call of a mid-size class probes hpctrain's
    shared-memory way and the library's on scratch and all ranks keep the faster (hpctrain.comm.measured_choice):
    every result equals numpy's, a repeated sum of real floats gives the same bits from the first call on,
    and every rank runs the same way for each collective."""
    from hpctrain.comm.measured_choice import TRIALS

    sub = comm.split(color=0, key=comm.rank)          # a new communicator: nothing measured on it yet
    n, r = sub.size, sub.rank
    count = (1 << 20) // 4 + 1000                     # just over 1 MiB of float32: the class (1, 4] MiB
    measured = sub._reductions.measured
    measures = measured is not None and n > 1 and sub.allreduce_algorithm(count * 4) == "shm"
    if measures:
        assert measured.decided == {}
    bounds = segment_bounds(count, n)
    for call in range(2 * (TRIALS + 1) + 2):
        xs = [data(k, count, np.float32, seed=call) for k in range(n)]
        summed = reference(xs, "sum", n)
        y = xs[r].copy()
        sub.allreduce(y, inplace=True)
        assert y.tobytes() == summed.tobytes(), call
        assert sub.allreduce(xs[r], op="max").tobytes() == reference(xs, "max", n).tobytes(), call
        assert sub.reduce_scatter(xs[r]).tobytes() == summed[bounds[r]:bounds[r + 1]].tobytes(), call
        assert sub.allgather(xs[r]).tobytes() == np.concatenate(xs).tobytes(), call
    floats = np.random.default_rng([5, r]).standard_normal(4 * count).astype(np.float32)   # the next class: measured here
    first = sub.allreduce(floats)
    for _ in range(3):
        assert sub.allreduce(floats).tobytes() == first.tobytes()
    decided = dict(measured.decided) if measured is not None else {}
    everyone = sub.allgather_object((sub.allreduce_algorithm(count * 4), sorted(decided.items())))
    assert all(d == everyone[0] for d in everyone), everyone
    if measures:
        assert {c for c, _ in decided} == {"allreduce", "reduce_scatter", "allgather"}, decided
        assert ("allreduce", 11) in decided and ("allreduce", 12) in decided, decided
        assert sub.allreduce_algorithm(count * 4) == ("shm" if decided[("allreduce", 11)] else "native")
    sub.free()
