"""Repeated small calls on this launch's ranks: the repeat path (plans remembered, the mailbox, the C kernel)
gives the results and bits of the first call, in place and out, for numpy and torch, and reports a
mismatch after it on every rank.
"""
import itertools

import numpy as np
import pytest

import hpctrain
from hpctrain.collectives.ops import segment_bounds
from hpctrain.tensors import BFLOAT16

from collective_inputs import OPS, data, repeat_expected, ordered_sum, reference, same_on_all_ranks, uses_c_kernel, valid


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_], ids=str)
def test_repeated_small_allreduce_takes_the_repeat_path_with_the_same_results(comm, dtype):
    """A repeated small call (the repeat path on one node) gives the reference, the same bits as the first call."""
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
            if repeat_expected(comm):    # (the path under test ran)
                assert (np.ndarray, x.dtype, x.shape, "allreduce", op, "auto", False) in comm._reductions.repeats


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64, np.float16], ids=str)
def test_repeated_small_inplace_allreduce_writes_into_the_input(comm, dtype):
    """In place, repeated (the repeat path after the first call): the reduction lands in the caller's array,
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
            if repeat_expected(comm):          # (float16 too: reduced as it is, nothing widens)
                assert (np.ndarray, x.dtype, x.shape, "allreduce", op, algorithm, True) in comm._reductions.repeats
    frozen = np.ones(4, dtype)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):         # (the repeat path refuses it; planning explains)
        comm.allreduce(frozen, inplace=True)


def test_repeated_small_torch_allreduce_in_place_and_out(comm):
    """torch CPU tensors on the repeat path: in place (a plain tensor, one that requires grad, one whose memory
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
    if repeat_expected(comm):
        assert (torch.Tensor, torch.float32, (6, 4), "allreduce", "max", "auto", True) in comm._reductions.repeats
    with pytest.raises((TypeError, hpctrain.CollectiveMismatchError), match="sparse"):   # (same key, refused)
        comm.allreduce(torch.zeros(6, 4).to_sparse(), op="max", inplace=True)


def test_repeated_small_allreduce_waits_for_the_async_calls_before_it(comm):
    """A repeated call after asynchronous ones runs after them, on every rank (else ranks would pair different calls)."""
    n = comm.size
    x = np.ones(8, np.float32)
    comm.allreduce(x, inplace=True)                  # (planned: the next ones take the repeat path)
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
    capacity = comm._backend._mailbox.capacity if getattr(comm._backend, "_mailbox", None) is not None else 1 << 16
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


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=str)
def test_repeated_small_sum_rounds_as_additions_in_rank_order(comm, dtype):
    """Inexact sums: the first (general) call and the repeated (repeat path, C kernel) ones equal the rank-order sum.

    On one node, that is; across nodes each node's sum is added in rank order
    and the node sums in the ring's order, so there the result is only close
    (and equal on every rank).
    """
    n, one_node = comm.size, getattr(comm._backend, "_mailbox", None) is not None or comm.size == 1

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
    if getattr(comm._backend, "_mailbox", None) is not None and comm._backend._mailbox._kernel is not None:
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
    if getattr(comm._backend, "_mailbox", None) is None or comm._backend._mailbox._kernel is None:
        pytest.skip("needs the MPI backend on one node with the C kernel built")
    sub = comm.split(0)                      # a fresh communicator: no call of it planned yet
    try:
        if sub.rank % 2:
            sub._backend._mailbox._kernel = None      # odd ranks exchange and reduce in Python
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
    # rank 1 changes its shape; the others repeat the call they made before (the repeat path)
    y = np.ones(17 if comm.rank == 1 else 16, np.float32)
    with pytest.raises(hpctrain.CollectiveMismatchError, match=r"rank 1[^\n]*float32\[17\]"):
        comm.allreduce(y)
    with pytest.raises(hpctrain.CollectiveMismatchError, match="op=max"):
        comm.allreduce(x, op="max" if comm.rank == 0 else "sum")
    assert comm.allreduce(x).tolist() == [comm.size] * 16
