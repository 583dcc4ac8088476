"""Where two features meet: optimizer wrappers checkpointed, resumed at the same and at another world size and
into another wrapper, and combined with elastic mode, each against a one-process reference or refused.

The rows and columns are the README's combinations matrix ("Combining features"); the cells tested elsewhere
name their test there.  References share no code with hpctrain: plain data parallelism is one torch optimizer
on every rank's batch at once; DiLoCo is simulated with one model copy and one inner AdamW per rank and
torch's SGD with Nesterov momentum as the outer optimizer, fed the averaged delta as its gradient.  A world
size change is simulated by the rule hpctrain documents (hpctrain.optim.local_sgd): the interrupted round's
outer step first, then every new copy from the global copy, new copy r with old copy (r mod N)'s inner state.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import hpctrain.torch as ht
from hpctrain import compression
from hpctrain.checkpoint import CheckpointError, CheckpointManager

B, H = 4, 4


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).double()


def data(step, n):
    g = torch.Generator().manual_seed(101 + step)
    return torch.randn(n * B, 6, generator=g, dtype=torch.float64), torch.randn(n * B, 3, generator=g,
                                                                                   dtype=torch.float64)


def step_on(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))


def diloco(model, comm):
    return ht.LocalSGDOptimizer(adamw(model), model.named_parameters(), sync_every=H, outer_lr=0.7,
                                outer_momentum=0.9, comm=comm)


def train(model, opt, steps, comm):
    """Steps ``steps`` on this rank's rows of the batch of ``comm.size`` ranks."""
    rows = slice(comm.rank * B, (comm.rank + 1) * B)
    for step in steps:
        x, y = data(step, comm.size)
        step_on(model, opt, x[rows], y[rows])


def smaller(comm):
    """The first n - 1 ranks (all of them at 1 rank), or None on the rank left out."""
    m = max(1, comm.size - 1)
    return comm.split(0 if comm.rank < m else None), m


def resumed_ends_where_the_unbroken_run_does(comm, ckdir, make, save_at, end, verify="warn"):
    """Train ``end`` steps straight; train ``save_at``, checkpoint, restore into a fresh model and ``make(model)``
    optimizer, train on to ``end``: the parameters must be the same bits."""
    straight = net()
    train(straight, make(straight), range(end), comm)
    model = net()
    opt = make(model)
    train(model, opt, range(save_at), comm)
    with CheckpointManager(ckdir, comm=comm, verify_replicas=verify) as manager:
        manager.save(save_at, {"model": model, "optimizer": opt})
    fresh = net(seed=5)
    opt2 = make(fresh)
    assert CheckpointManager(ckdir, comm=comm).restore({"model": fresh, "optimizer": opt2}) == save_at
    train(fresh, opt2, range(save_at, end), comm)
    assert torch.equal(flat(fresh), flat(straight)), "the resumed run differs from the run never stopped"


def simulate_diloco(schedule, start=None, inner_state=None):
    """The DiLoCo copies after ``schedule``, ``[(first step, end step, ranks), ...]``, in one process."""
    glob = copy.deepcopy(start) if start is not None else net()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    copies, inner, since = [], [], 0

    def outer_step():
        outer.zero_grad()
        for g, *cs in zip(glob.parameters(), *(c.parameters() for c in copies)):
            g.grad = sum(g.detach() - c.detach() for c in cs) / len(copies)
        outer.step()
        for c in copies:
            c.load_state_dict(glob.state_dict())

    for first, end, n in schedule:
        if n != len(copies):
            if since:
                outer_step()
                since = 0
            states = [o.state_dict() for o in inner] or [inner_state]
            copies = [copy.deepcopy(glob) for _ in range(n)]
            inner = [adamw(c) for c in copies]
            for k, o in enumerate(inner):
                if states[k % len(states)] is not None:
                    o.load_state_dict(copy.deepcopy(states[k % len(states)]))
        for step in range(first, end):
            x, y = data(step, n)
            for k in range(n):
                step_on(copies[k], inner[k], x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
            since += 1
            if (step + 1) % H == 0:
                outer_step()
                since = 0
    return copies


@pytest.mark.parametrize("order", ["model first", "optimizer first"])
def test_diloco_resumed_at_the_same_size_goes_on_as_if_never_stopped(comm, ckdir, order):
    """Saved mid-round (step 6 of rounds of 4) as the quickstart saves, restored into fresh objects: each rank's
    own parameters and inner state come back with the outer state, bit for bit (whatever the entries' order)."""
    straight = net()
    train(straight, diloco(straight, comm), range(12), comm)
    model = net()
    opt = diloco(model, comm)
    train(model, opt, range(6), comm)
    manager = CheckpointManager(ckdir, comm=comm, verify_replicas="off")
    entries = (("model", model), ("optimizer", opt))
    manager.save(6, dict(entries if order == "model first" else entries[::-1]))
    manager.wait()
    fresh = net(seed=5)
    opt2 = diloco(fresh, comm)
    state = dict((("model", fresh), ("optimizer", opt2)) if order == "model first" else
                 (("optimizer", opt2), ("model", fresh)))
    assert CheckpointManager(ckdir, comm=comm).restore(state) == 6
    assert opt2.local_sgd.steps == 6 and opt2.local_sgd.syncs == 1
    train(fresh, opt2, range(6, 12), comm)
    assert torch.equal(flat(fresh), flat(straight)), "the resumed run differs from the run never stopped"
    ref = simulate_diloco([(0, 12, comm.size)])
    torch.testing.assert_close(flat(fresh), flat(ref[comm.rank]), rtol=1e-9, atol=1e-12)


def test_diloco_resumed_at_another_size_finishes_the_round_and_goes_on(comm, ckdir):
    """Saved mid-round by n ranks, restored by n - 1: the interrupted round's outer step, then every rank from
    the global copy with saved rank (r mod n)'s inner state; equal to the simulation through the same sizes."""
    n = comm.size
    model = net()
    opt = diloco(model, comm)
    train(model, opt, range(6), comm)
    with CheckpointManager(ckdir, comm=comm, verify_replicas="off") as manager:
        manager.save(6, {"model": model, "optimizer": opt})
    sub, m = smaller(comm)
    if sub is None:
        return
    fresh = net(seed=5)
    opt2 = diloco(fresh, sub)
    assert CheckpointManager(ckdir, comm=sub).restore({"model": fresh, "optimizer": opt2}) == 6
    assert opt2.local_sgd.syncs == (2 if m != n else 1)      # (the interrupted round finished at another size)
    train(fresh, opt2, range(6, 13), sub)
    ref = simulate_diloco([(0, 6, n), (6, 13, m)])
    torch.testing.assert_close(flat(fresh), flat(ref[sub.rank]), rtol=1e-9, atol=1e-12)


def test_rounds_of_a_time_resumed_at_another_size_finish_the_round_and_count_every_saved_step(comm, ckdir):
    """``sync_every_s``: rank r did 3 + r local steps of a round not yet over when saved; restored by n - 1 ranks
    (rounds of a microsecond now: a sync every step): the round is finished as one-process outer SGD (Nesterov)
    on the mean of every saved rank's delta, every rank starts from it, and ``global_steps`` counts every
    step ever done, the saved ranks' and the new ones'."""
    def timed(model, c, seconds):
        return ht.LocalSGDOptimizer(adamw(model), model.named_parameters(), sync_every_s=seconds, outer_lr=0.7,
                                    outer_momentum=0.9, comm=c)

    n = comm.size
    model = net()
    opt = timed(model, comm, 3600.0)
    train(model, opt, range(3 + comm.rank), comm)
    saved = comm.allgather_object(flat(model))
    with CheckpointManager(ckdir, comm=comm, verify_replicas="off") as manager:
        manager.save(1, {"model": model, "optimizer": opt})
    sub, m = smaller(comm)
    if sub is None or m == n:
        return
    fresh = net(seed=5)
    opt2 = timed(fresh, sub, 1e-6)
    assert CheckpointManager(ckdir, comm=sub).restore({"model": fresh, "optimizer": opt2}) == 1
    glob = net()
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    start = flat(glob)
    mean_delta = sum(start - p for p in saved) / n
    offset = 0
    for p in glob.parameters():
        p.grad = mean_delta[offset:offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    outer.step()
    torch.testing.assert_close(flat(fresh), flat(glob), rtol=1e-12, atol=1e-14)
    done = sum(3 + r for r in range(n))
    assert opt2.local_sgd.global_steps == done
    train(fresh, opt2, range(2), sub)
    assert opt2.local_sgd.global_steps == done + 2 * m and opt2.local_sgd.syncs == 1 + 2


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_checkpoint_restores_into_a_plain_optimizer_with_its_state(comm, ckdir, stage):
    """ShardedOptimizer saved by n ranks, restored by n - 1 ranks into DistributedOptimizer and by one process
    into a bare Adam: the moments and step counts come back (gathered whole), and training goes on as one
    process's Adam on the same batches."""
    n = comm.size
    model, ref = net(), net()
    opt = ht.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=stage, bucket_mb=0.0002)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    train(model, opt, range(4), comm)
    for step in range(4):
        step_on(ref, ref_opt, *data(step, n))
    with CheckpointManager(ckdir, comm=comm) as manager:
        manager.save(4, {"model": model, "optimizer": opt})
    sub, m = smaller(comm)
    if sub is not None:
        fresh = net(seed=5)
        plain = ht.DistributedOptimizer(torch.optim.Adam(fresh.parameters(), lr=0.01), fresh.named_parameters(),
                                        comm=sub)
        assert CheckpointManager(ckdir, comm=sub).restore({"model": fresh, "optimizer": plain}) == 4
        assert len(plain.state) == len(list(fresh.parameters())), "Adam's state was not restored"
        ref2 = copy.deepcopy(ref)
        ref2_opt = torch.optim.Adam(ref2.parameters(), lr=0.01)
        ref2_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))     # (torch would share the moments)
        train(fresh, plain, range(4, 8), sub)
        for step in range(4, 8):
            step_on(ref2, ref2_opt, *data(step, m))
        torch.testing.assert_close(flat(fresh), flat(ref2), rtol=1e-9, atol=1e-12)
    alone = comm.split(0 if comm.rank == 0 else None)
    if alone is not None:
        bare_model = net(seed=5)
        bare = torch.optim.Adam(bare_model.parameters(), lr=0.01)
        assert CheckpointManager(ckdir, comm=alone).restore({"model": bare_model, "optimizer": bare}) == 4
        for key in ("exp_avg", "exp_avg_sq", "step"):
            for p, q in zip(bare_model.parameters(), ref.parameters()):
                torch.testing.assert_close(bare.state[p][key], ref_opt.state[q][key], rtol=1e-9, atol=1e-15)


def test_a_plain_checkpoint_starts_diloco_from_its_state(comm, ckdir):
    """Plain data parallelism (DistributedOptimizer over AdamW) for 4 steps, resumed as DiLoCo: the global copy
    is the restored model and every rank's inner AdamW takes the saved moments."""
    n = comm.size
    ref = net()
    ref_opt = adamw(ref)
    for step in range(4):
        step_on(ref, ref_opt, *data(step, n))
    plain_model = net()
    plain_opt = ht.DistributedOptimizer(adamw(plain_model), plain_model.named_parameters(), comm=comm)
    train(plain_model, plain_opt, range(4), comm)
    with CheckpointManager(ckdir, comm=comm) as manager:
        manager.save(4, {"model": plain_model, "optimizer": plain_opt})
    fresh = net(seed=5)
    opt2 = diloco(fresh, comm)
    assert CheckpointManager(ckdir, comm=comm).restore({"optimizer": opt2, "model": fresh}) == 4
    train(fresh, opt2, range(4, 11), comm)
    copies = simulate_diloco([(4, 11, n)], start=ref, inner_state=ref_opt.state_dict())
    torch.testing.assert_close(flat(fresh), flat(copies[comm.rank]), rtol=1e-9, atol=1e-12)


def test_what_would_lose_state_is_refused_in_one_line(comm, ckdir, monkeypatch):
    """A DiLoCo checkpoint into a plain optimizer, a plain value into an optimizer; local SGD, Adasum and a
    compressor that keeps state between steps in elastic mode."""
    model = net()
    opt = diloco(model, comm)
    train(model, opt, range(2), comm)
    with CheckpointManager(ckdir, comm=comm, verify_replicas="off") as manager:
        manager.save(2, {"model": model, "optimizer": opt, "extra": {"epoch": 1}})
    plain = ht.DistributedOptimizer(adamw(net()), comm=comm)
    with pytest.raises(CheckpointError, match=r"'optimizer' is a LocalSGDOptimizer's state .* spread over "
                                              rf"{comm.size} ranks, and state\['optimizer'\] is a DistributedAdamW"):
        CheckpointManager(ckdir, comm=comm).restore({"model": net(), "optimizer": plain})
    with pytest.raises(CheckpointError, match=r"plain value for 'extra', but state\['extra'\] is a DistributedAdamW"):
        CheckpointManager(ckdir, comm=comm).restore({"model": net(), "optimizer": diloco(net(), comm),
                                                     "extra": plain})
    monkeypatch.setenv("HPCTRAIN_ELASTIC", "1")
    with pytest.raises(ValueError, match="local SGD / DiLoCo does not follow a re-formed world yet"):
        diloco(net(), comm)
    with pytest.raises(ValueError, match="op='adasum' does not follow a re-formed world yet"):
        ht.DistributedOptimizer(adamw(net()), op="adasum")
    # a compressor that keeps state between steps (residuals, choices seeded by the step) is refused; the casts
    # keep none and follow the world (tests/test_elastic.py, the fp16 case)
    for name in ("topk", "powersgd", "randomk", "qsgd"):
        with pytest.raises(ValueError, match=rf"compression {type(compression.get(name)).__name__}\(.*does not "
                                             rf"follow a re-formed world yet .*use compression 'fp16', 'bf16' or none"):
            ht.DistributedOptimizer(adamw(net()), comm=comm, compression=name)
    for name in ("fp16", "bf16", "none"):
        ht.DistributedOptimizer(adamw(net()), comm=comm, compression=name)


def test_plain_local_sgd_resumed_at_the_same_size_goes_on_as_if_never_stopped(comm, ckdir):
    """Periodic averaging without an outer optimizer, SGD with momentum, saved mid-round: bit for bit."""
    def local(model):
        return ht.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    model.named_parameters(), sync_every=H, comm=comm)

    resumed_ends_where_the_unbroken_run_does(comm, ckdir, local, save_at=5, end=11, verify="off")


@pytest.mark.parametrize("warmup", [0, 2])
def test_local_sgd_with_accumulated_passes_equals_synchronous_sgd_on_the_whole_batch(comm, warmup):
    """Two backward passes a step (the first under no_sync), H = 1 without an outer optimizer: SGD with momentum
    on every rank's whole batch at once, during the warm-up and after it."""
    n, r = comm.size, comm.rank
    model, ref = net(), net()
    opt = ht.LocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
                               sync_every=1, warmup_steps=warmup, comm=comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        x, y = data(step, n)
        xs, ys = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
        opt.zero_grad()
        with opt.no_sync():
            F.mse_loss(model(xs[:B // 2]), ys[:B // 2]).backward()
        F.mse_loss(model(xs[B // 2:]), ys[B // 2:]).backward()
        opt.step()
        step_on(ref, ref_opt, x, y)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-10, atol=1e-12)


def test_adasum_keeps_each_ranks_own_optimizer_state_through_a_checkpoint(comm, ckdir):
    """op='adasum' steps each rank's Adam on its own gradients (moments differ between ranks): restored at the
    same size the run ends bit for bit where the unbroken one does; at n - 1 ranks rank r holds saved rank r's."""
    def make(model, c):
        return ht.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model.named_parameters(),
                                       op="adasum", comm=c)

    straight = net()
    train(straight, make(straight, comm), range(8), comm)
    model = net()
    opt = make(model, comm)
    train(model, opt, range(5), comm)
    with CheckpointManager(ckdir, comm=comm, verify_replicas="error") as manager:
        manager.save(5, {"model": model, "optimizer": opt})
    saved = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    fresh = net(seed=5)
    opt2 = make(fresh, comm)
    assert CheckpointManager(ckdir, comm=comm).restore({"model": fresh, "optimizer": opt2}) == 5
    train(fresh, opt2, range(5, 8), comm)
    assert torch.equal(flat(fresh), flat(straight)), "the resumed Adasum run differs from the run never stopped"
    with pytest.raises(CheckpointError, match=r"'optimizer' is an optimizer state that is each rank's own"):
        plain = ht.DistributedOptimizer(torch.optim.Adam(net().parameters(), lr=0.01), comm=comm)
        CheckpointManager(ckdir, comm=comm).restore({"model": net(), "optimizer": plain})
    sub, _ = smaller(comm)
    if sub is not None:
        other = net(seed=6)
        opt3 = make(other, sub)
        assert CheckpointManager(ckdir, comm=sub).restore({"model": other, "optimizer": opt3}) == 5
        for key, value in opt3.state[next(iter(other.parameters()))].items():
            assert torch.equal(value, saved[key]), f"rank {comm.rank}: {key} is not its own saved state"


@pytest.mark.parametrize("compression", ["fp16", "topk", "powersgd"])
def test_compressed_gradients_of_accumulated_passes_equal_one_pass_of_the_larger_batch(comm, compression):
    """backward_passes_per_step=2 with a compressor (a cast; top-k with its error feedback; PowerSGD of rank 1 from
    the first step): the same steps as one pass of the two passes' samples with the same compressor (the local mean
    is compressed once, at the last pass)."""
    import hpctrain.compression as C

    def make(model, passes):
        comp = {"topk": lambda: C.TopK(ratio=0.3), "powersgd": lambda: C.PowerSGD(rank=1, start_iter=0)}.get(
            compression, lambda: compression)()
        return ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       model.named_parameters(), compression=comp, backward_passes_per_step=passes,
                                       compression_policy=C.Policy(min_numel=0, skip=()), comm=comm)

    r = comm.rank
    model, ref = net(), net()
    opt, ref_opt = make(model, 2), make(ref, 1)
    for step in range(5):
        x, y = data(step, comm.size)
        xs, ys = x[r * B:(r + 1) * B], y[r * B:(r + 1) * B]
        opt.zero_grad()
        for half in (slice(0, B // 2), slice(B // 2, B)):
            F.mse_loss(model(xs[half]), ys[half]).backward()
        opt.step()
        step_on(ref, ref_opt, xs, ys)
    torch.testing.assert_close(flat(model), flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_zero_checkpoint_resumed_at_the_same_size_goes_on_bit_for_bit(comm, ckdir, stage):
    """Each rank's chunks back into a fresh ShardedOptimizer of the same world: the run ends where the unbroken
    one does, bit for bit."""
    def make(model):
        return ht.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=stage, bucket_mb=0.0002,
                                   comm=comm)

    resumed_ends_where_the_unbroken_run_does(comm, ckdir, make, save_at=4, end=8)


def test_a_compressors_residuals_restore_by_rank_at_a_smaller_size(comm, ckdir):
    """Top-k's error-feedback residuals saved as Sharded(compressor) by n ranks and restored by n - 1: rank r
    holds saved rank r's residuals, bit for bit (those of the removed rank are not loaded anywhere)."""
    import numpy as np

    import hpctrain.compression as C
    from hpctrain.checkpoint import Sharded

    def make(model, c):
        comp = C.TopK(ratio=0.3)
        return comp, ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                             compression=comp, compression_policy=C.Policy(min_numel=0, skip=()),
                                             comm=c)

    model = net()
    comp, opt = make(model, comm)
    train(model, opt, range(3), comm)
    with CheckpointManager(ckdir, comm=comm) as manager:
        manager.save(3, {"model": model, "optimizer": opt, "compressor": Sharded(comp)})
    saved = {k: {n: a.copy() for n, a in s.arrays.items()} for k, s in comp.slots.items()}
    assert saved and any(np.any(a) for s in saved.values() for a in s.values())
    sub, _ = smaller(comm)
    if sub is not None:
        fresh = net(seed=5)
        comp2, opt2 = make(fresh, sub)
        assert CheckpointManager(ckdir, comm=sub).restore({"model": fresh, "optimizer": opt2,
                                                           "compressor": Sharded(comp2)}) == 3
        assert comp2.slots.keys() == saved.keys()
        for k, s in comp2.slots.items():
            for n, a in s.arrays.items():
                assert np.array_equal(a, saved[k][n]), f"rank {comm.rank}: {k}/{n} is not its own saved residual"
