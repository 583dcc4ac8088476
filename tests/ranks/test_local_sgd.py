"""LocalSGDOptimizer (local SGD, DiLoCo) on every rank of a launch, against one-process torch references.

References share no code with hpctrain: synchronous training is a plain optimizer on all ranks' batches at
once; DiLoCo is simulated with one model copy and one inner AdamW per rank and torch's own SGD with Nesterov
momentum as the outer optimizer, fed the averaged delta as its gradient.
"""
import copy
import time

import pytest
import torch
import torch.nn.functional as F

import hpctrain.torch as ht

B = 4


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).double()


def data(step, n):
    g = torch.Generator().manual_seed(31 + step)
    return torch.randn(n * B, 6, generator=g, dtype=torch.float64), torch.randn(n * B, 3, generator=g,
                                                                                   dtype=torch.float64)


def step_on(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_identical_across_ranks(comm, model):
    assert len(set(comm.allgather_object(flat(model).numpy().tobytes()))) == 1, "replicas differ"


def test_every_step_without_outer_optimizer_equals_synchronous_training(comm):
    """H = 1, no outer optimizer, SGD with momentum in two param groups (a linear update): the ranks' mean after
    each local step is the synchronous step on the averaged gradient."""
    n, r = comm.size, comm.rank
    model, ref = net(), net()

    def sgd(m):
        return torch.optim.SGD([{"params": m[0].parameters(), "lr": 0.05}, {"params": m[2].parameters()}],
                               lr=0.1, momentum=0.9, weight_decay=0.01)
    opt = ht.LocalSGDOptimizer(sgd(model), model.named_parameters(), sync_every=1)
    ref_opt = sgd(ref)
    for step in range(6):
        x, y = data(step, n)
        rows = slice(r * B, (r + 1) * B)
        step_on(model, opt, x[rows], y[rows])
        step_on(ref, ref_opt, x, y)
        assert_identical_across_ranks(comm, model)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-10, atol=1e-12)
    assert opt.local_sgd.syncs == 6


@pytest.mark.parametrize("warmup", [0, 2])
def test_diloco_equals_a_one_process_simulation_of_its_rule(comm, warmup):
    """DiLoCo's defaults (inner AdamW lr 4e-4, weight decay 0.1, betas 0.9/0.95; outer SGD Nesterov lr 0.7,
    momentum 0.9), H = 3, with and without 2 synchronous warm-up steps: after every outer step each rank's
    parameters are the global copy, and they equal the simulation's."""
    n, r, H = comm.size, comm.rank, 3

    def adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))
    model = net()
    opt = ht.LocalSGDOptimizer(adamw(model), model.named_parameters(), sync_every=H, warmup_steps=warmup,
                               outer_lr=0.7, outer_momentum=0.9)
    ref = net()
    ref_opt = adamw(ref)
    steps = warmup + 3 * H
    for step in range(warmup):            # the warm-up: synchronous training, on the whole batch here
        step_on(ref, ref_opt, *data(step, n))
    glob = copy.deepcopy(ref)
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    copies = [copy.deepcopy(ref) for _ in range(n)]
    inner = [adamw(c) for c in copies]
    for o in inner:
        o.load_state_dict(copy.deepcopy(ref_opt.state_dict()))     # (torch would share the moment tensors)
    for step in range(steps):
        x, y = data(step, n)
        rows = slice(r * B, (r + 1) * B)
        step_on(model, opt, x[rows], y[rows])
        if step < warmup:
            continue
        for k in range(n):
            step_on(copies[k], inner[k], x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        if (step + 1 - warmup) % H == 0:
            outer.zero_grad()
            for g, *cs in zip(glob.parameters(), *(c.parameters() for c in copies)):
                g.grad = sum(g.detach() - c.detach() for c in cs) / n
            outer.step()
            for c in copies:
                c.load_state_dict(glob.state_dict())
            assert_identical_across_ranks(comm, model)
            torch.testing.assert_close(flat(model), flat(glob), rtol=1e-9, atol=1e-12)
    assert opt.local_sgd.syncs == 3 and opt.local_sgd.steps == steps


def test_bytes_on_the_wire_fall_h_fold(comm):
    """Over 8 steps, H = 4 sends a quarter of what gradient averaging sends (the parameters and the gradients
    have the same size; the gradient buckets carry a flag per tensor more)."""
    if comm.size == 1:
        pytest.skip("one rank sends nothing")
    log = comm.comm_log
    log.start()
    sent = {}
    for name, make in (("sync", lambda o, m: ht.DistributedOptimizer(o, m.named_parameters())),
                       ("local", lambda o, m: ht.LocalSGDOptimizer(o, m.named_parameters(), sync_every=4))):
        model = net()
        opt = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
        comm.barrier()
        log.clear()
        for step in range(8):
            x, y = data(step, comm.size)
            step_on(model, opt, x[:B], y[:B])
        sent[name] = log.totals()[1]
    values = sum(p.numel() for p in net().parameters())
    assert sent["local"] > 0 and values > 0
    assert 3.5 <= sent["sync"] / sent["local"] <= 4.5, sent


def test_a_compressed_delta_keeps_the_replicas_alike_and_bad_settings_are_refused(comm):
    model = net()
    opt = ht.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, outer_lr=0.7,
                               compression="fp16")
    for step in range(4):
        x, y = data(step, comm.size)
        step_on(model, opt, x[comm.rank * B:(comm.rank + 1) * B], y[comm.rank * B:(comm.rank + 1) * B])
    assert_identical_across_ranks(comm, model)
    with pytest.raises(ValueError, match="sync_every >= 1"):
        ht.LocalSGDOptimizer(torch.optim.SGD(net().parameters(), lr=0.1), sync_every=0)
    with pytest.raises(ValueError, match="lr > 0"):
        ht.LocalSGDOptimizer(torch.optim.SGD(net().parameters(), lr=0.1), outer_lr=-1.0)


def test_rounds_of_a_time_let_a_fast_rank_step_more_and_each_sync_is_the_mean_of_the_ranks_models(comm):
    """sync_every_s: the last rank is slower; within a round each rank steps alone as often as it can, and each
    sync leaves every rank with the mean of the ranks' models after their local steps (no outer optimizer)."""
    n, r = comm.size, comm.rank
    model = net()
    opt = ht.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               sync_every_s=0.03)
    local, mine, budget = opt.local_sgd, 0, 60 * n
    while local.global_steps < budget:          # (the same on every rank after each sync: all stop together)
        if r == n - 1 and n > 1:
            time.sleep(0.01)
        x, y = data(mine, 1)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            local_step = flat(model) - 0.05 * torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        syncs = local.syncs
        opt.step()
        mine += 1
        if local.syncs > syncs:
            theirs = comm.allgather_object(local_step.numpy())
            torch.testing.assert_close(flat(model), torch.from_numpy(sum(theirs) / n), rtol=1e-12, atol=1e-14)
            assert_identical_across_ranks(comm, model)
    counts = comm.allgather_object(mine)
    assert local.global_steps == sum(counts) >= budget
    if n > 1:
        assert counts[0] > counts[-1], f"the fast rank did {counts[0]} steps, the slow one {counts[-1]}"
    with pytest.raises(ValueError, match="sync_every_s must be"):
        ht.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                             sync_every_s=0)
