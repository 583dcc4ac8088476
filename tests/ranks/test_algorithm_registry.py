"""An all-reduce algorithm added from outside hpctrain: one function, one registration, selected by name.

The toy gathers every rank's buffer at rank 0 over point-to-point messages,
reduces them there in rank order and broadcasts the result.  Its results are
checked against numpy reducing the same inputs in the same order, and a
counter proves that the toy, not another algorithm, produced them.
"""
import numpy as np
import pytest

import hpctrain
from hpctrain.collectives import registry

UFUNCS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}
calls = []


def gather_sum_broadcast(links, acc, op):
    """Gather to rank 0, reduce in rank order, broadcast: ``out = ((x_0 op x_1) op x_2) ...``."""
    calls.append(acc.size)
    t = links.transport
    if links.rank == 0:
        parts = [np.empty_like(acc) for _ in range(links.size - 1)]
        t.waitall([t.irecv(p, i + 1) for i, p in enumerate(parts)])
        for p in parts:
            UFUNCS[op](acc, p, out=acc)
    else:
        t.waitall([t.isend(acc, 0)])
    links.broadcast(acc.reshape(-1).view(np.uint8), 0)
    return acc


@pytest.fixture
def toy():
    registry.register(registry.Algorithm("toy-gather", "allreduce", run=gather_sum_broadcast, backends=("mpi",),
                                         summary="gather to rank 0, reduce in rank order, broadcast"))
    calls.clear()
    yield "toy-gather"
    registry.unregister("allreduce", "toy-gather")


def inputs(rank, count, dtype):
    rng = np.random.default_rng(1000 + rank)
    if np.dtype(dtype).kind == "f":
        return (rng.standard_normal(count) * 100).astype(dtype)
    return rng.integers(-50, 50, count).astype(dtype)


def in_rank_order(n, count, dtype, op):
    out = inputs(0, count, dtype).copy()
    for r in range(1, n):
        UFUNCS[op](out, inputs(r, count, dtype), out=out)
    return out / n if op == "avg" else out


@pytest.mark.parametrize("dtype, op", [(d, op) for d in (np.float32, np.float64, np.int32)
                                       for op in ("sum", "max", "prod", "avg") if d != np.int32 or op != "avg"])
@pytest.mark.parametrize("count", [1, 7, 1000, 65_537])
def test_a_registered_toy_allreduce_runs_by_name_and_matches_numpy(comm, toy, dtype, op, count):
    if comm.backend != "mpi":
        pytest.skip("the toy sends point-to-point messages, which only the MPI backend has")
    assert toy in comm.allreduce_algorithms()
    got = comm.allreduce(inputs(comm.rank, count, dtype), op=op, algorithm=toy)
    want = in_rank_order(comm.size, count, dtype, op).astype(dtype)
    assert got.dtype == np.dtype(dtype) and np.array_equal(got, want)     # same order: the same bits
    assert calls == ([count] if comm.size > 1 else [])      # (a world of one has nothing to reduce)


def test_reduce_scatter_with_the_toy_takes_the_own_block_of_its_allreduce(comm, toy):
    if comm.backend != "mpi":
        pytest.skip("the toy sends point-to-point messages, which only the MPI backend has")
    x = inputs(comm.rank, 10 * comm.size + 3, np.float64).reshape(-1, 1)
    got = comm.reduce_scatter(x, algorithm=toy)
    rows = np.array_split(in_rank_order(comm.size, x.size, np.float64, "sum").reshape(-1, 1), comm.size)
    assert np.array_equal(got, rows[comm.rank])


def test_auto_takes_the_toy_only_when_it_says_it_is_cheapest(comm, toy):
    if comm.backend != "mpi":
        pytest.skip("the toy sends point-to-point messages, which only the MPI backend has")
    assert comm.allreduce_algorithm(1 << 20) != toy           # no cost estimate: only when named
    registry.register(registry.Algorithm(toy, "allreduce", run=gather_sum_broadcast, backends=("mpi",),
                                         cost=lambda where, nbytes: 0.1 if nbytes < 4096 else None), replace=True)
    assert comm.allreduce_algorithm(100) == toy and comm.allreduce_algorithm(1 << 20) != toy
    got = comm.allreduce(np.full(3, comm.rank + 1.0))
    assert np.array_equal(got, np.full(3, comm.size * (comm.size + 1) / 2))
    assert calls == ([3] if comm.size > 1 else [])


def test_an_unknown_or_foreign_algorithm_is_refused_on_every_rank_naming_the_choices(comm):
    with pytest.raises((ValueError, hpctrain.CollectiveMismatchError),
                       match="unknown algorithm 'toy-gather'.*expected one of auto, native"):
        comm.allreduce(np.ones(3), algorithm="toy-gather")      # (not registered outside the fixture)
    with pytest.raises(ValueError, match="'auto'"):
        registry.register(registry.Algorithm("auto", "allreduce", run=gather_sum_broadcast))
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.Algorithm("native", "allreduce", run=gather_sum_broadcast))
