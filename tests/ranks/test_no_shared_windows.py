"""Under an MPI that cannot allocate MPI-3 shared windows (launched with ``--mca osc ^sm,ucx``) hpctrain still works.

The call check falls back to the gather to rank 0, ``auto`` to MPI's own
collectives and ``shared_empty`` to ``numpy.empty``; the shared-memory
algorithms are refused on every rank with the reason.
"""
import numpy as np
import pytest
import torch

import hpctrain
from collective_inputs import data, reference, same_on_all_ranks
from test_safety import raised_everywhere, still_works


def test_the_launch_really_has_no_shared_windows(comm):
    from mpi4py import MPI
    if comm.size == 1:
        pytest.skip("one rank opens no windows")
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    with pytest.raises(MPI.Exception):
        MPI.Win.Allocate_shared(64, 1, comm=node)
    node.Free()


@pytest.mark.parametrize("count", [1000, 70_000, 1_500_000])      # carried by the check, mid-size, past shm_min_bytes
@pytest.mark.parametrize("op", ["sum", "max"])
def test_auto_allreduce_equals_the_reference(comm, count, op):
    n = comm.size
    got = comm.allreduce(data(comm.rank, count, np.float32, op), op=op)
    np.testing.assert_array_equal(got, reference([data(r, count, np.float32, op) for r in range(n)], op, n))
    assert same_on_all_ranks(comm, got)


def test_grouped_and_allgather_and_reduce_scatter(comm):
    n, r = comm.size, comm.rank
    xs = [data(r, c, np.float32, seed=c) for c in (3, 5000, 70_000)]
    for got, c in zip(comm.grouped_allreduce(xs), (3, 5000, 70_000)):
        np.testing.assert_array_equal(got, reference([data(k, c, np.float32, seed=c) for k in range(n)], "sum", n))
    rows = comm.allgather(np.full((2, 3), r, dtype=np.int64))
    np.testing.assert_array_equal(rows, np.repeat(np.arange(n), 2)[:, None] * np.ones(3, dtype=np.int64))
    part = comm.reduce_scatter(np.ones(4 * n, dtype=np.float64))
    np.testing.assert_array_equal(part, np.full(4, float(n)))


def test_shared_empty_is_plain_memory_and_reduces_in_place(comm):
    buf = comm.shared_empty(50_000, np.float32)
    buf[:] = comm.rank + 1
    comm.allreduce(buf, inplace=True)
    np.testing.assert_array_equal(buf, np.full(50_000, comm.size * (comm.size + 1) / 2, dtype=np.float32))


def test_shared_memory_algorithms_are_refused_with_the_reason(comm):
    if comm.size == 1:
        pytest.skip("one rank needs no shared memory")
    for alg in ("shm", "hierarchical"):
        msg = raised_everywhere(comm, lambda: comm.allreduce(np.ones(10), algorithm=alg))
        assert "cannot allocate MPI-3 shared-memory windows" in msg and alg in msg, msg
    still_works(comm)


def test_a_mismatch_is_still_reported_by_the_gather_check(comm):
    if comm.size == 1:
        pytest.skip("a world of one rank cannot disagree with itself")
    msg = raised_everywhere(comm, lambda: comm.allreduce(np.ones(3 if comm.rank == 0 else 4)))
    assert "float64[3]" in msg and "float64[4]" in msg
    still_works(comm)


def test_torch_distributed_optimizer_trains(comm):
    import hpctrain.torch as ht
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(), comm=comm)
    ht.broadcast_parameters(model.state_dict(), root=0, comm=comm)
    x = torch.randn(4 * comm.size, 8, generator=torch.Generator().manual_seed(1))
    ref = torch.nn.Linear(8, 2)
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(x[4 * comm.rank:4 * comm.rank + 4]).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
