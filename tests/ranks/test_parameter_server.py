"""ParameterServer on every rank of a launch (the last ranks serve), against one-process torch references.

References share no code with hpctrain: plain torch SGD on the batches the workers used, computed on every
worker. At one rank a parameter server cannot run: the error says so.
"""
import time

import pytest
import torch
import torch.nn.functional as F

import hpctrain.torch as ht

B = 4


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).double()


def data(worker, step):
    g = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def needs(comm, ranks):
    if comm.size < ranks:
        with pytest.raises(ValueError, match="needs at least servers \\+ 1"):
            ht.ParameterServer(net(), lr=0.1, servers=comm.size)
        pytest.skip(f"needs {ranks} ranks (the error at {comm.size} was checked)")


def test_one_worker_with_staleness_0_is_plain_sgd_with_momentum_over_sharded_servers(comm):
    """All ranks but rank 0 serve (1-3 shards); the one worker's model equals torch's SGD after every step."""
    needs(comm, 2)
    model, ref = net(), net(seed=0)
    ps = ht.ParameterServer(model, lr=0.1, momentum=0.9, weight_decay=0.01, servers=comm.size - 1, staleness=0)
    if ps.is_server:
        ps.serve()
        return
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    try:                    # (a failed check still lets the servers finish: the next test starts cleanly)
        for step in range(6):
            x, y = data(0, step)
            F.mse_loss(model(x), y).backward()
            ps.step()
            ref_opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            ref_opt.step()
            torch.testing.assert_close(flat(model), flat(ref), rtol=1e-12, atol=1e-14)
            assert all(p.grad is None for p in model.parameters())
    finally:
        ps.finish()
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-12, atol=1e-14)


def test_staleness_0_without_momentum_is_synchronous_sgd_on_the_averaged_gradient(comm):
    """One server, the other ranks train: with S = 0 every worker sees the synchronous model after every step."""
    needs(comm, 2)
    model, ref = net(), net()
    ps = ht.ParameterServer(model, lr=0.2, servers=1, staleness=0)
    if ps.is_server:
        ps.serve()
        return
    w, workers = ps.worker_rank, ps.num_workers
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    try:
        for step in range(5):
            if w == workers - 1:
                time.sleep(0.02)          # (a slower worker: the others must wait for it)
            x, y = data(w, step)
            F.mse_loss(model(x), y).backward()
            ps.step()
            xs, ys = zip(*(data(v, step) for v in range(workers)))
            ref_opt.zero_grad()
            F.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()     # (the mean of the workers' mean losses)
            ref_opt.step()
            torch.testing.assert_close(flat(model), flat(ref), rtol=1e-10, atol=1e-12)
            assert ps.global_steps == (step + 1) * workers       # (every push of this step, none of the next)
    finally:
        ps.finish()
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-10, atol=1e-12)


def pushes_in(model, start, lr, workers):
    """How many pushes the parameters hold, when every gradient is all ones (loss = sum of the parameters)."""
    return float(((start - flat(model)) * workers / lr).mean())


@pytest.mark.parametrize("staleness", [1, 3])
def test_a_worker_never_runs_more_than_the_staleness_bound_ahead_of_the_slowest(comm, staleness):
    """The last worker is slow; each reply the others take holds every push of every worker up to S behind."""
    needs(comm, 3)
    model = net()
    ps = ht.ParameterServer(model, lr=1e-3, servers=1, staleness=staleness)
    if ps.is_server:
        ps.serve()
        return
    start, workers = flat(model), ps.num_workers
    try:
        for step in range(8):
            if ps.worker_rank == workers - 1:
                time.sleep(0.03)
            sum(p.sum() for p in model.parameters()).backward()
            ps.step()
            clock = step + 1
            seen = pushes_in(model, start, 1e-3, workers)
            # every other worker has pushed at least clock - S times, this one clock times
            assert seen >= clock + (workers - 1) * max(0, clock - staleness) - 1e-6, (clock, seen)
    finally:
        ps.finish()
    assert pushes_in(model, start, 1e-3, workers) == pytest.approx(8 * workers, abs=1e-6)


def test_compressed_pushes_carry_what_the_compressor_keeps(comm):
    """fp16 pushes, one worker: the model equals SGD on gradients rounded to float16."""
    needs(comm, 2)
    model, ref = net(), net()
    ps = ht.ParameterServer(model, lr=0.1, servers=1, staleness=0, compression="fp16")
    if ps.is_server:
        ps.serve()
        return
    if ps.worker_rank != 0:
        for step in range(4):
            F.mse_loss(model(data(ps.worker_rank, step)[0]), data(ps.worker_rank, step)[1]).backward()
            ps.step()
        ps.finish()
        return
    try:
        for step in range(4):
            x, y = data(0, step)
            F.mse_loss(model(x), y).backward()
            ps.step()
    finally:
        ps.finish()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    # every worker's push is rounded to float16 and averaged over the workers; recompute all of them
    for step in range(4):
        ref_opt.zero_grad()
        grads = []
        for v in range(ps.num_workers):
            ref.zero_grad()
            x, y = data(v, step)
            F.mse_loss(ref(x), y).backward()
            grads.append([p.grad.float().half().double() for p in ref.parameters()])
        with torch.no_grad():
            for i, p in enumerate(ref.parameters()):
                p -= 0.1 * sum(g[i] for g in grads) / ps.num_workers
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-6, atol=1e-7)


def test_bad_arguments_are_refused_on_every_rank(comm):
    with pytest.raises(ValueError, match="staleness must be"):
        ht.ParameterServer(net(), lr=0.1, staleness=-1)
    with pytest.raises(ValueError, match="servers must be"):
        ht.ParameterServer(net(), lr=0.1, servers=0)
    with pytest.raises(ValueError, match="one dtype"):
        ht.ParameterServer(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).double()), lr=0.1)
    with pytest.raises(ValueError, match="runs collectives of its own"):
        ht.ParameterServer(net(), lr=0.1, compression="powersgd")


def test_with_a_backup_worker_each_step_is_the_mean_of_the_first_gradients_and_the_slowest_is_dropped(comm):
    """One backup worker, the last worker 0.25 s slower a step: the fast workers' model after each step is SGD on
    the mean of the fast workers' gradients alone (the slow one's arrive too late and are dropped)."""
    needs(comm, 3)
    model, ref = net(), net()
    ps = ht.ParameterServer(model, lr=0.2, servers=1, backup_workers=1)
    if ps.is_server:
        ps.serve()
        assert ps.server.dropped >= 1
        return
    w, workers = ps.worker_rank, ps.num_workers
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    try:
        for step in range(3 if w == workers - 1 else 6):
            if w == workers - 1:
                time.sleep(0.25)
            x, y = data(w, step)
            F.mse_loss(model(x), y).backward()
            ps.step()
            if w == workers - 1:
                continue
            xs, ys = zip(*(data(v, step) for v in range(workers - 1)))
            ref_opt.zero_grad()
            F.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
            ref_opt.step()
            torch.testing.assert_close(flat(model), flat(ref), rtol=1e-10, atol=1e-12)
    finally:
        ps.finish()


def test_a_gradient_that_is_not_finite_is_skipped_and_counted(comm):
    """One worker's step-2 gradient holds a NaN: the servers do not apply it (torch's SGD skipping that step is
    the reference, momentum included) and count it; training goes on."""
    needs(comm, 2)
    model, ref = net(), net(seed=0)
    ps = ht.ParameterServer(model, lr=0.1, momentum=0.9, servers=comm.size - 1, staleness=0)
    if ps.is_server:
        ps.serve()
        assert ps.server.skipped == 1 and ps.server.pushes == 5
        return
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    try:
        for step in range(6):
            x, y = data(0, step)
            F.mse_loss(model(x), y).backward()
            if step == 2:
                next(model.parameters()).grad[0, 0] = float("nan")
            ps.step()
            if step != 2:
                ref_opt.zero_grad()
                F.mse_loss(ref(x), y).backward()
                ref_opt.step()
            torch.testing.assert_close(flat(model), flat(ref), rtol=1e-12, atol=1e-14)
    finally:
        ps.finish()
    assert ps.global_steps == 5
