"""Disagreeing or invalid calls raise on every rank, naming the ranks, and the job goes on afterwards."""
import re

import numpy as np
import pytest

import hpctrain
from hpctrain import CollectiveMismatchError


def raised_everywhere(comm, fn, match=None):
    """Call ``fn`` on every rank; return the error text after checking that every rank raised it."""
    err = None
    try:
        fn()
    except (ValueError, TypeError) as exc:
        err = exc
    flags = comm.allgather_object(err is not None)
    assert all(flags), f"only ranks {[r for r, f in enumerate(flags) if f]} raised"
    if comm.size > 1:
        assert isinstance(err, CollectiveMismatchError), type(err)
    if match:
        assert re.search(match, str(err)), str(err)
    texts = comm.allgather_object(str(err))
    assert len(set(texts)) == 1, "every rank must get the same message"
    return str(err)


def still_works(comm):
    out = comm.allreduce(np.ones(4))
    np.testing.assert_array_equal(out, np.full(4, comm.size))


def last(comm):
    return comm.size - 1


def test_shape_mismatch(comm):
    if comm.size == 1:
        pytest.skip("a world of one rank cannot disagree with itself")
    r, n = comm.rank, comm.size
    msg = raised_everywhere(comm, lambda: comm.allreduce(np.ones(3 + (r == n - 1), dtype=np.float32)))
    assert "float32[4]" in msg and "float32[3]" in msg
    assert f"rank {n - 1}:" in msg or f"ranks {n - 1}" in msg
    still_works(comm)


def test_dtype_op_and_kind_mismatch(comm):
    if comm.size == 1:
        pytest.skip("a world of one rank cannot disagree with itself")
    r, n = comm.rank, comm.size
    raised_everywhere(comm, lambda: comm.allreduce(np.ones(3, dtype=np.float64 if r else np.float32)),
                      match="float64.*\n.*float32|float32.*\n.*float64")
    raised_everywhere(comm, lambda: comm.allreduce(np.ones(3), op="max" if r == n - 1 else "sum"), match="op=max")
    raised_everywhere(comm, lambda: comm.allgather(np.ones(2)) if r == 0 else comm.allreduce(np.ones(2)),
                      match="allgather.*\n.*allreduce")
    raised_everywhere(comm, lambda: comm.allgather(np.ones((2, 3 + (r == 0)))), match=r"\[2,4\]")
    still_works(comm)


def test_root_mismatch(comm):
    if comm.size == 1:
        pytest.skip("a world of one rank cannot disagree with itself")
    r = comm.rank
    raised_everywhere(comm, lambda: comm.broadcast(np.ones(2), root=1 if r == 0 else 0), match="root=1")
    raised_everywhere(comm, lambda: comm.broadcast_object("x", root=1 if r == 0 else 0), match="root=1")
    still_works(comm)


def test_invalid_argument_on_one_rank(comm):
    r, n = comm.rank, comm.size
    bad = n - 1
    msg = raised_everywhere(comm, lambda: comm.allreduce(np.ones(3), op="bogus" if r == bad else "sum"),
                            match="bogus")
    if n > 1:
        assert "INVALID" in msg
    raised_everywhere(comm, lambda: comm.broadcast(np.ones(3), root=n + 5 if r == bad else 0), match="root")
    raised_everywhere(comm, lambda: comm.allreduce(np.ones(3, dtype=np.int32), op="avg"), match="avg")
    raised_everywhere(comm, lambda: comm.allreduce(np.ones(3, dtype=bool), op="sum"), match="bool")
    raised_everywhere(comm, lambda: comm.allreduce(np.ones(3, dtype=np.complex64)), match="complex64")
    raised_everywhere(comm, lambda: comm.allreduce(np.ones(3), algorithm="fastest"), match="fastest")
    if n > 1:
        raised_everywhere(comm, lambda: comm.alltoall(np.ones(n + 1)), match="divisible")
    raised_everywhere(comm, lambda: comm.alltoall(np.ones(n), splits=[1] * (n - 1) + [2]), match="splits")
    raised_everywhere(comm, lambda: comm.allgather(np.float32(1.0)), match="dimension")
    raised_everywhere(comm, lambda: comm.split(color=-1 if r == bad else 0), match="color")
    still_works(comm)


@pytest.mark.parametrize("op", ["Average", "mean"])
def test_an_unknown_op_on_every_rank_is_named_with_the_valid_ops_not_as_a_disagreement(comm, op):
    msg = raised_everywhere(comm, lambda: comm.allreduce(np.ones(3), op=op), match=f"unknown reduction op '{op}'")
    assert "sum, avg, min, max, prod" in msg and "disagree" not in msg, msg
    if comm.size > 1:
        assert "the same on every rank" in msg and "invalid argument to allreduce(" in msg, msg
    still_works(comm)


def test_async_mismatch_reported_at_wait(comm):
    if comm.size == 1:
        pytest.skip("a world of one rank cannot disagree with itself")
    r = comm.rank
    ok = comm.allreduce_async(np.ones(2))
    bad = comm.allreduce_async(np.ones(2 + r))
    after = comm.allreduce_async(np.ones(5))
    np.testing.assert_array_equal(ok.wait(), np.full(2, comm.size))
    raised_everywhere(comm, bad.wait, match="disagree")
    np.testing.assert_array_equal(after.wait(), np.full(5, comm.size))


def test_mismatch_on_sub_communicator_names_world_ranks(comm):
    if comm.size < 3:
        pytest.skip("needs a sub-communicator of at least 2 ranks")
    r = comm.rank
    sub = comm.split(color=0 if r > 0 else None)
    if sub is not None:
        err = None
        try:
            sub.allreduce(np.ones(1 + (sub.rank == sub.size - 1)))
        except CollectiveMismatchError as exc:
            err = str(exc)
        assert err is not None and "world.split(0)" in err and "(world" in err
        sub.allreduce(np.ones(2))
    comm.barrier()


def test_mismatch_between_a_riding_and_a_large_buffer(comm):
    """On one node small inputs travel with the call check; a rank whose input is too large for that,
    or who asks for another algorithm, still meets them there and every rank hears of the mismatch."""
    if comm.size == 1:
        pytest.skip("a world of one rank cannot disagree with itself")
    r, n = comm.rank, comm.size
    big = 2 * hpctrain.world().config.shm_small_bytes // 4 + 1       # too large to ride even as float32
    msg = raised_everywhere(comm, lambda: comm.allreduce(np.ones(10 if r < n - 1 else big, dtype=np.float32)))
    assert f"float32[{big}]" in msg and "float32[10]" in msg
    msg = raised_everywhere(comm, lambda: comm.allreduce(np.ones(10), algorithm="native" if r == 0 else "shm"))
    assert "algorithm=native" in msg and "shm" in msg
    for _ in range(3):                                                  # both slots of the mailbox
        still_works(comm)
