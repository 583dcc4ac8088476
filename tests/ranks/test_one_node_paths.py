"""The one-node paths on this launch's ranks: results written in place, the shared-memory reduction and its
arena, grouped all-reduces (fusion), shared buffers, results held by the caller, and direct copies between
ranks, each against a numpy reference and, where the order of additions is fixed, bit for bit.
"""
import numpy as np
import pytest

import hpctrain

from collective_inputs import (algorithms, data, direct_copies_expected, group_of, ordered_sum, reference,
                               same_on_all_ranks, summed, valid)


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
    h = torch.full((5,), float(r + 1), dtype=torch.float16)  # summed as float16, copied back
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


@pytest.mark.share_counts
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64], ids=str)
def test_large_allreduce_copying_between_ranks_rounds_in_rank_order(comm, dtype):
    """Large one-node all-reduces (the direct copies between ranks): rank-order bits, in place, out of place, fused.

    Several blocks per segment with a short last one, a fused group whose
    tensors straddle the blocks and segments, inexact floats (so a wrong
    order shows); on one node with the MPI backend the bits equal numpy's left-to-right sum, and
    across fake nodes (the hierarchical form) the result is within
    ``n eps sum|x|`` and the same on every rank.
    """
    from hpctrain.comm.backends.mpi.direct import DIRECT_MIN_BYTES_OVERSUBSCRIBED as most     # (both thresholds)
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
        assert bool(comm._backend._direct.usable) == direct_copies_expected(comm)


def test_large_allreduce_uses_the_arena_on_every_rank_when_one_rank_turns_direct_copies_off(comm):
    """HPCTRAIN_CROSS_MEMORY=0 on one rank (rank 0) makes every rank use the arena: they still meet and agree."""
    import dataclasses

    if not direct_copies_expected(comm):
        pytest.skip("needs the MPI backend on one node, several ranks, with direct copies on")
    from hpctrain.comm.backends.mpi.direct import DIRECT_MIN_BYTES_OVERSUBSCRIBED as most
    sub = comm.split(0)                      # a fresh communicator: not probed yet
    config = sub._rt.config
    try:
        if sub.rank == 0:
            sub._rt.config = dataclasses.replace(config, cross_memory=False)
        xs = [np.random.default_rng([7, r]).standard_normal(most // 4 + 3).astype(np.float32)
              for r in range(sub.size)]
        out = sub.allreduce(xs[sub.rank])
        sub._rt.config = config
        assert sub._backend._direct.usable is False
        assert out.tobytes() == ordered_sum(xs, "sum", sub.size).tobytes()
        assert same_on_all_ranks(comm, out)
    finally:
        sub._rt.config = config
        sub.free()
