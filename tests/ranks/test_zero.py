"""ShardedOptimizer (ZeRO stages 1 and 2) on every rank of a launch, against plain torch optimizers in one process.

The reference trains a copy of the model with the plain optimizer on all ranks' batches at once (the mean loss
over ``n x B`` samples is the average of the ranks' mean losses), so it shares no code with hpctrain.  The
model has 119 parameters (a prime: no world size divides it), one parameter no rank gives a gradient, and the
buckets are tiny, so chunks cut across parameters and buckets.  Also checked as torch's own
ZeroRedundancyOptimizer tests check theirs: exact numbers on one parameter, balanced shards, cross-loading
state dicts with plain optimizers both ways, and loading at another world size.
"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

import hpctrain.torch as ht

B, STEPS = 4, 6


class Net(torch.nn.Module):
    """6 -> 11 -> 3 with tanh, and a parameter the forward pass never uses: 66 + 11 + 33 + 3 + 6 = 119 values."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(6, 11), torch.nn.Linear(11, 3)
        self.unused = torch.nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


OPTIMIZERS = {
    # two param groups with their own learning rates (and a scheduler below)
    "sgd_momentum": lambda m: torch.optim.SGD([{"params": [m.a.weight, m.a.bias], "lr": 0.05},
                                               {"params": [m.b.weight, m.b.bias, m.unused]}], lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
}


def data(step, n):
    g = torch.Generator().manual_seed(77 + step)
    return torch.randn(n * B, 6, generator=g), torch.randn(n * B, 3, generator=g)


def local_step(model, opt, x, y, rank, passes=1):
    """One step on this rank's rows of (x, y), in ``passes`` backward passes of equal size."""
    opt.zero_grad()
    rows = slice(rank * B, (rank + 1) * B)
    for xs, ys in zip(x[rows].chunk(passes), y[rows].chunk(passes)):
        F.mse_loss(model(xs), ys).backward()
    opt.step()


def reference_step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def assert_close(got, want, rtol=1e-5):
    for (name, p), q in zip(got.named_parameters(), want.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=1e-7, msg=lambda m: f"{name}: {m}")


def assert_identical_across_ranks(comm, model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert len(set(comm.allgather_object(flat.numpy().tobytes()))) == 1, "replicas differ"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_training_equals_the_plain_optimizer_on_the_whole_batch(comm, name, stage):
    n, r = comm.size, comm.rank
    model, ref = Net(), Net()
    opt = ht.ShardedOptimizer(OPTIMIZERS[name](model), stage=stage, named_parameters=model.named_parameters(),
                              bucket_mb=0.0002)         # about 52 values a bucket: chunks cut across tensors
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_opt = OPTIMIZERS[name](ref)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    sync = opt._hpctrain_zero.sync
    assert len(sync.buckets) > 2
    for step in range(STEPS):
        x, y = data(step, n)
        local_step(model, opt, x, y, r)
        sched.step()
        reference_step(ref, ref_opt, x, y)
        ref_sched.step()
        assert_identical_across_ranks(comm, model)
        if stage == 2:      # the parameters' own gradients were dropped once packed
            assert all(p.grad is None for p in model.parameters())
    assert_close(model, ref)
    assert torch.equal(model.unused, ref.unused)        # (no rank had a gradient for it: it kept its value)
    # balanced shards: every rank owns ceil or floor of each bucket's 1/n, all of it owned once
    owned = comm.allgather_object([sync.layout.own(b) for b in range(len(sync.buckets))])
    for b, bucket in enumerate(sync.buckets):
        spans = [owned[k][b] for k in range(n)]
        assert spans[0][0] == 0 and spans[-1][1] == bucket.numel
        assert all(spans[k][1] == spans[k + 1][0] for k in range(n - 1))
        assert max(hi - lo for lo, hi in spans) - min(hi - lo for lo, hi in spans) <= n - 1
    # the optimizer state this rank holds: 1/n of the plain optimizer's moments (up to a bucket's rounding)
    per_value = {"sgd_momentum": 4, "adam": 8, "adamw": 8}[name]
    counters = sum(4 for _ in sync.buckets) if name != "sgd_momentum" else 0      # (a step count per chunk)
    whole = 119 * per_value
    assert opt.shard_bytes() - counters <= whole / n + per_value * len(sync.buckets)


def test_allgathers_overlapped_with_the_next_forward_give_the_same_training(comm, ckdir):
    """overlap_allgather=True: step() leaves the allgathers in flight; each layer's forward finishes its own
    bucket first.  The training equals the plain optimizer's, and a checkpoint of the model taken right after
    a step (no forward since) holds the step's values."""
    n, r = comm.size, comm.rank
    model, ref = Net(), Net()
    opt = ht.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), bucket_mb=0.0002,
                              overlap_allgather=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = data(step, n)
        local_step(model, opt, x, y, r)
        reference_step(ref, ref_opt, x, y)
        if n > 1 and step == 0:
            assert opt._hpctrain_zero.pending        # (left in flight by step())
    from hpctrain.checkpoint import CheckpointManager

    with CheckpointManager(ckdir, comm=comm) as manager:      # (it finishes the allgathers before reading)
        manager.save(STEPS, {"model": model, "optimizer": opt})
    assert not opt._hpctrain_zero.pending and opt._hpctrain_zero._hook is None
    assert_close(model, ref)
    assert_identical_across_ranks(comm, model)
    saved = Net(seed=9)
    assert CheckpointManager(ckdir, comm=comm).restore({"model": saved}) == STEPS
    assert_close(saved, ref)


def test_accumulated_passes_equal_one_larger_batch(comm):
    n, r = comm.size, comm.rank
    model, ref = Net(), Net()
    opt = ht.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=2, backward_passes_per_step=2,
                              bucket_mb=0.0002)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = data(step, n)
        local_step(model, opt, x, y, r, passes=2)
        reference_step(ref, ref_opt, x, y)
    assert_close(model, ref)


def test_one_parameter_takes_the_exact_steps_of_plain_sgd(comm):
    """torch's ZeroRedundancyOptimizer test_state_dict numbers: x = 1, gradient 1 on every rank, SGD lr 0.1,
    momentum 0.9: 0.9, then 0.71; then lr 0.01 set on the param group."""
    x, plain = torch.tensor([1.0], requires_grad=True), torch.tensor([1.0], requires_grad=True)
    opt = ht.ShardedOptimizer(torch.optim.SGD([x], lr=0.1, momentum=0.9), stage=2)
    ref = torch.optim.SGD([plain], lr=0.1, momentum=0.9)
    seen = []
    for step in range(3):
        if step == 2:
            opt.param_groups[0]["lr"] = ref.param_groups[0]["lr"] = 0.01
        for t, o in ((x, opt), (plain, ref)):
            o.zero_grad()
            t.sum().backward()
            o.step()
        assert torch.equal(x, plain)
        seen.append(x.item())
    assert seen == pytest.approx([0.9, 0.71, 0.6829], abs=1e-6)


def test_state_dicts_cross_load_with_plain_optimizers_both_ways(comm):
    n, r = comm.size, comm.rank
    # plain -> sharded: a plain Adam trained 3 steps, its state loaded into a sharded one, both go on
    ref = Net()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        reference_step(ref, ref_opt, *data(step, n))
    model = copy.deepcopy(ref)
    opt = ht.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), bucket_mb=0.0002)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for step in range(3, 6):
        local_step(model, opt, *data(step, n), r)
        reference_step(ref, ref_opt, *data(step, n))
    assert_close(model, ref)
    # sharded -> plain: the consolidated state (on every rank) loads into a plain Adam that goes on as the other
    opt.consolidate_state_dict(to=None)
    whole = opt.state_dict()
    want = ref_opt.state_dict()["state"]
    # (the parameter no rank had a gradient for has zero moments here, no entry in the plain optimizer's)
    assert set(want) <= set(whole["state"]) and len(whole["state"]) == 5
    for k, entry in want.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(whole["state"][k][key], entry[key], rtol=1e-5, atol=1e-7)
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    plain_opt.load_state_dict(whole)
    for step in range(6, 9):
        reference_step(plain, plain_opt, *data(step, n))
        reference_step(ref, ref_opt, *data(step, n))
    assert_close(plain, ref)


def test_a_state_gathered_at_one_size_loads_at_a_smaller_one(comm):
    """Resharding: the whole state of n ranks goes on over the first n - 1 (or 1) ranks' own sharding."""
    n, r = comm.size, comm.rank
    model, ref = Net(), Net()
    opt = ht.ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1), bucket_mb=0.0002)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(3):
        local_step(model, opt, *data(step, n), r)
        reference_step(ref, ref_opt, *data(step, n))
    opt.consolidate_state_dict(to=None)
    whole = opt.state_dict()
    m = max(1, n - 1)
    sub = comm.split(0 if r < m else None)
    if sub is None:
        return
    smaller = copy.deepcopy(model)
    opt2 = ht.ShardedOptimizer(torch.optim.AdamW(smaller.parameters(), lr=0.01, weight_decay=0.1), comm=sub,
                               bucket_mb=0.0002)
    opt2.load_state_dict(whole)
    for step in range(3, 6):
        local_step(smaller, opt2, *data(step, m), r)
        reference_step(ref, ref_opt, *data(step, m))
    assert_close(smaller, ref)


@pytest.mark.parametrize("async_save", [False, True])
def test_a_checkpoint_holds_each_ranks_chunks_and_restores_at_a_smaller_size(comm, ckdir, async_save):
    """Each rank writes its own chunks (no rank gathers the whole state); the first n - 1 (or 1) ranks restore
    it into their own sharding, and training goes on as the plain optimizer does."""
    from hpctrain.checkpoint import CheckpointManager
    from safetensors import safe_open

    n, r = comm.size, comm.rank
    model, ref = Net(), Net()
    opt = ht.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), bucket_mb=0.0002)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        local_step(model, opt, *data(step, n), r)
        reference_step(ref, ref_opt, *data(step, n))
    with CheckpointManager(ckdir, async_save=async_save, comm=comm) as manager:
        manager.save(3, {"model": model, "optimizer": opt})
    with safe_open(os.path.join(manager.step_dir(3), f"shard-{r}.safetensors"), "pt") as f:
        values = sum(f.get_slice(k).get_shape()[0] for k in f.keys())     # (this rank's chunks, nobody else's)
    zero = opt._hpctrain_zero
    assert values == 2 * sum(zero.layout.own_numel(b) for b in range(len(zero.chunks)))
    m = max(1, n - 1)
    sub = comm.split(0 if r < m else None)
    if sub is not None:
        fresh = Net(seed=5)
        opt2 = ht.ShardedOptimizer(torch.optim.Adam(fresh.parameters(), lr=0.01), comm=sub, bucket_mb=0.0003)
        assert CheckpointManager(ckdir, comm=sub).restore({"model": fresh, "optimizer": opt2}) == 3
        for step in range(3, 6):
            local_step(fresh, opt2, *data(step, m), r)
            reference_step(ref, ref_opt, *data(step, m))
        assert_close(fresh, ref)


def test_what_cannot_be_sharded_is_refused(comm):
    model = Net()
    with pytest.raises(ValueError, match="element by element.*LBFGS"):
        ht.ShardedOptimizer(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(ValueError, match="compression.*all-reduce only"):
        ht.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="fp16")
    with pytest.raises(ValueError, match="stage must be 1"):
        ht.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), stage=3)
    opt = ht.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="already distributed"):
        ht.ShardedOptimizer(opt)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        opt.state_dict()
    opt.remove_hooks()
