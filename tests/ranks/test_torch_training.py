"""Data-parallel PyTorch training equals single-process training on the concatenated batch.

Every rank also computes the reference itself: one process (no communication)
training a copy of the model on the batches of all ranks concatenated.  With a
mean loss, the average over N ranks of the gradient of batch B equals the
gradient of the N*B batch, so parameters must agree up to float32 rounding
(the sums are taken in a different order): 1e-5 relative after 20 steps.
Replicas must be bit-identical to each other after every step.
"""
import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hpctrain.torch as ht
from hpctrain.data import DistributedSampler

B = 4          # per-rank batch
STEPS = 20


def make_model(seed=0, bn=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU()]
    if bn:
        layers.append(torch.nn.BatchNorm2d(4))
    layers += [torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)]
    return torch.nn.Sequential(*layers)


def batches(step, n, per_rank=B, seed=1234):
    """The per-rank batches of one step for all n ranks: list of (x, y)."""
    g = torch.Generator().manual_seed(seed + step)
    x = torch.randn(n * per_rank, 1, 6, 6, generator=g)
    y = torch.randint(0, 3, (n * per_rank,), generator=g)
    return [(x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank]) for r in range(n)]


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def assert_identical_across_ranks(comm, model, what=""):
    digest = hashlib.sha256(flat_params(model).numpy().tobytes()).hexdigest()
    digests = comm.allgather_object(digest)
    assert len(set(digests)) == 1, f"replicas differ {what}: {digests}"


def assert_close(model, ref, rtol=1e-5):
    got, want = flat_params(model).double(), flat_params(ref).double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rtol, f"max relative difference {err:.3g} > {rtol}"


OPTIMIZERS = {
    # two param groups with different learning rates, and a scheduler
    "sgd_momentum": lambda m: torch.optim.SGD([{"params": list(m.parameters())[:2], "lr": 0.05},
                                               {"params": list(m.parameters())[2:]}], lr=0.1, momentum=0.9),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
}


@pytest.mark.parametrize("scheduler_first", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_matches_single_process_with_n_times_the_batch(comm, name, scheduler_first):
    n, r = comm.size, comm.rank
    model, ref = make_model(seed=r), make_model()          # replicas start different: broadcast fixes it
    opt = OPTIMIZERS[name](model)
    if scheduler_first:    # the scheduler wraps opt.step before DistributedOptimizer sees it
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    opt = ht.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  bucket_mb=0.001)        # tiny buckets: several in flight during backward
    if not scheduler_first:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ht.broadcast_parameters(model.state_dict(), root=0)
    ref_opt = OPTIMIZERS[name](ref)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    assert len(opt._hpctrain.buckets) > 1
    for step in range(STEPS):
        parts = batches(step, n)
        opt.zero_grad()
        F.cross_entropy(model(parts[r][0]), parts[r][1]).backward()
        assert opt._hpctrain.launched == len(opt._hpctrain.buckets)  # all sent during backward
        opt.step()
        sched.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        ref_opt.step()
        ref_sched.step()
        assert_identical_across_ranks(comm, model, f"after step {step}")
    assert_close(model, ref)


@pytest.mark.parametrize("mode", ["backward_passes_per_step", "no_sync"])
def test_accumulation_equals_k_times_larger_batch(comm, mode):
    n, r, k = comm.size, comm.rank, 3
    model, ref = make_model(), make_model()
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  backward_passes_per_step=k if mode == "backward_passes_per_step" else 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        parts = batches(step, n, per_rank=k * B)
        opt.zero_grad()
        x, y = parts[r]
        for i in range(k):
            micro = slice(i * B, (i + 1) * B)
            if mode == "no_sync" and i < k - 1:
                with opt.no_sync():
                    F.cross_entropy(model(x[micro]), y[micro]).backward()
            else:
                F.cross_entropy(model(x[micro]), y[micro]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        ref_opt.step()
        assert_identical_across_ranks(comm, model)
    assert_close(model, ref)


def test_clipping_inside_skip_synchronize_uses_the_averaged_gradient(comm):
    n, r = comm.size, comm.rank
    model, ref = make_model(), make_model()
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(5):
        parts = batches(step, n)
        opt.zero_grad()
        F.cross_entropy(model(parts[r][0]), parts[r][1]).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        assert_identical_across_ranks(comm, model)
    assert_close(model, ref)


class TwoHeads(torch.nn.Module):
    """A trunk, two heads (each rank uses one of them) and a parameter nobody uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(5, 8)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)])
        self.unused = torch.nn.Parameter(torch.ones(3))

    def forward(self, x, head):
        return self.heads[head](torch.relu(self.trunk(x)))


def test_unused_parameters_count_as_zero_and_never_hang(comm):
    n, r = comm.size, comm.rank
    model, ref = TwoHeads(), TwoHeads()
    opt = ht.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), bucket_mb=0)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(7)
    for step in range(5):
        xs = torch.randn(n, B, 5, generator=g)
        ys = torch.randint(0, 2, (n, B), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(xs[r], r % 2), ys[r]).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(F.cross_entropy(ref(xs[q], q % 2), ys[q]) for q in range(n)).div(n).backward()
        ref_opt.step()
        assert_identical_across_ranks(comm, model)
    assert model.unused.grad is None and torch.equal(model.unused.detach(), torch.ones(3))
    if n == 1:
        assert model.heads[1].weight.grad is None  # no rank used head 1: it keeps no gradient
    assert_close(model, ref)


def test_uneven_inputs_finish_with_join(comm):
    n, r = comm.size, comm.rank
    steps = [3 + q for q in range(n)]          # rank q has 3 + q batches
    model, ref = make_model(), make_model()
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with ht.Join(opt) as join:
        for step in range(steps[r]):
            x, y = batches(step, n)[r]
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    assert join.steps_joined == max(steps) - steps[r]
    for step in range(max(steps)):               # ranks that ran out contribute zeros; divide by n
        parts = batches(step, n)
        ref_opt.zero_grad()
        sum(F.cross_entropy(ref(parts[q][0]), parts[q][1]) for q in range(n) if step < steps[q]).div(n).backward()
        ref_opt.step()
    assert_identical_across_ranks(comm, model)
    assert_close(model, ref)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_gathered_or_densified_equal_one_process(comm, sparse_as_dense):
    """The sparse policy: rows gathered, or densified to travel (the grad stays sparse); some ranks skip the table."""
    n, r = comm.size, comm.rank

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.table, self.head = torch.nn.Embedding(20, 4, sparse=True), torch.nn.Linear(12, 1)

        def forward(self, idx, use_table):
            e = self.table(idx) if use_table else torch.ones(idx.shape + (4,))
            return self.head(e.flatten(1))

    uses = [q % 3 != 1 for q in range(n)]           # rank 1 never touches the table
    model, ref = Net(), Net()
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sparse_as_dense=sparse_as_dense,
                                  comm=comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        idx = torch.randint(0, 20, (n, B, 3), generator=g)
        opt.zero_grad()
        model(idx[r], uses[r]).pow(2).mean().backward()
        opt.step()
        if uses[r]:         # densified only to travel: the optimizer still gets a sparse gradient
            assert model.table.weight.grad.is_sparse
        ref_opt.zero_grad()
        sum(ref(idx[q], uses[q]).pow(2).mean() for q in range(n)).div(n).backward()
        ref_opt.step()
        assert_identical_across_ranks(comm, model)
    assert_close(model, ref)


def test_join_with_sparse_gradients(comm):
    """A rank that has run out of data sends no rows, not its last step's gradient again."""
    n, r = comm.size, comm.rank
    steps = [2 + q for q in range(n)]

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(20, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(12, 1))
    model, ref = build(), build()
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), comm=comm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    idx = torch.randint(0, 20, (max(steps), n, B, 3), generator=torch.Generator().manual_seed(5))
    with ht.Join(opt) as join:
        for step in range(steps[r]):
            opt.zero_grad()
            model(idx[step, r]).pow(2).mean().backward()
            opt.step()
    assert join.steps_joined == max(steps) - steps[r]
    for step in range(max(steps)):
        ref_opt.zero_grad()
        sum(ref(idx[step, q]).pow(2).mean() for q in range(n) if step < steps[q]).div(n).backward()
        ref_opt.step()
    assert_identical_across_ranks(comm, model)
    assert_close(model, ref)


def test_broadcast_makes_replicas_and_optimizer_state_identical(comm):
    r = comm.rank
    model = make_model(seed=100 + r)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (r + 1))
    if r == 0:   # only the root has optimizer state (moments, step counts)
        F.cross_entropy(model(batches(0, 1)[0][0]), batches(0, 1)[0][1]).backward()
        opt.step()
    ht.broadcast_parameters(model.state_dict(), root=0)
    ht.broadcast_optimizer_state(opt, root=0)
    assert_identical_across_ranks(comm, model)
    state = opt.state_dict()
    assert state["param_groups"][0]["lr"] == pytest.approx(0.01)
    moments = torch.cat([s["exp_avg_sq"].reshape(-1) for s in state["state"].values()])
    assert len(state["state"]) == len(list(model.parameters())) and moments.abs().sum() > 0
    digests = comm.allgather_object(hashlib.sha256(moments.numpy().tobytes()).hexdigest())
    assert len(set(digests)) == 1


def test_sync_batchnorm_equals_batchnorm_on_the_whole_batch(comm):
    n, r = comm.size, comm.rank
    model = ht.convert_sync_batchnorm(make_model(bn=True))
    ref = make_model(bn=True)
    assert isinstance(model[2], ht.SyncBatchNorm)
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        parts = batches(step, n)
        opt.zero_grad()
        F.cross_entropy(model(parts[r][0]), parts[r][1]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        ref_opt.step()
    assert_close(model, ref)
    for name in ("running_mean", "running_var"):
        np.testing.assert_allclose(getattr(model[2], name).numpy(), getattr(ref[2], name).numpy(), rtol=1e-5)
    model.eval(), ref.eval()
    x = batches(99, 1)[0][0]
    np.testing.assert_allclose(model(x).detach().numpy(), ref(x).detach().numpy(), rtol=1e-4, atol=1e-6)


def test_mismatched_models_are_refused_on_every_rank(comm):
    n, r = comm.size, comm.rank
    width = 3 + (r == n - 1 and n > 1)            # the last rank builds a different model
    model = torch.nn.Linear(2, width)
    if n == 1:
        ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        return
    with pytest.raises(ValueError, match=f"rank {n - 1}.*") as info:
        ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert "disagree on the parameters" in str(info.value)


def test_backward_twice_before_step_is_an_error(comm):
    model = make_model()
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(0, 1)[0]
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="backward\\(\\) ran again"):
        F.cross_entropy(model(x), y).backward()
    opt.step()   # the first step's collectives finish on every rank


def test_metric_average_and_sampler_shards_cover_the_data(comm):
    n, r = comm.size, comm.rank
    avg = ht.average_metrics({"loss": torch.tensor(float(r)), "acc": r * 2})
    assert avg == {"loss": (n - 1) / 2, "acc": float(n - 1)}
    sampler = DistributedSampler(101, seed=5)
    mine = sampler.indices()
    everyone = comm.allgather_object(mine)
    assert all(len(s) == len(mine) == len(sampler) for s in everyone)
    assert sorted(set(i for s in everyone for i in s)) == list(range(101))


def adasum_reference_run(n, make_opt, steps, passes=1, fp16=False, seed=0):
    """Horovod's Adasum optimizer simulated in one process: n replicas with their own optimizer state, each
    steps on its own batch, the deltas are combined tensor by tensor (numpy Adasum), every replica takes the result."""
    from hpctrain.collectives.adasum import adasum_reference
    models = [make_model(seed) for _ in range(n)]
    opts = [make_opt(m) for m in models]
    for step in range(steps):
        deltas = []
        for r, (m, opt) in enumerate(zip(models, opts)):
            start = [p.detach().clone() for p in m.parameters()]
            opt.zero_grad()
            for k in range(passes):
                x, y = batches(step * passes + k, n)[r]
                F.cross_entropy(m(x), y).backward()
            opt.step()
            deltas.append([(p.detach() - s).numpy() for p, s in zip(m.parameters(), start)])
        new = []
        for i, s in enumerate(start):
            ds = [d[i].astype(np.float16) if fp16 else d[i] for d in deltas]
            combined = adasum_reference(ds) if n > 1 else ds[0]
            new.append(s + torch.from_numpy(combined.astype(np.float32)) if n > 1 else None)
        if n > 1:
            with torch.no_grad():
                for m in models:
                    for p, v in zip(m.parameters(), new):
                        p.copy_(v)
    return models[0]


ADASUM_CASES = {"sgd_momentum": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 1, None),
                "adam_2_passes": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), 2, None),
                "adamw_fp16": (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 1, "fp16")}


@pytest.mark.parametrize("case", sorted(ADASUM_CASES))
def test_adasum_combines_the_ranks_deltas_as_horovod_does(comm, case):
    make_opt, passes, compression = ADASUM_CASES[case]
    n, r, steps = comm.size, comm.rank, 4
    model = make_model()
    opt = ht.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(), op="adasum",
                                  backward_passes_per_step=passes, compression=compression)
    def train(m, o, check=False):
        for step in range(steps):
            o.zero_grad()
            for k in range(passes):
                x, y = batches(step * passes + k, n)[r]
                F.cross_entropy(m(x), y).backward()
            o.step()
            if check:
                assert_identical_across_ranks(comm, m, f"after step {step}")

    train(model, opt, check=True)
    ref = adasum_reference_run(n, make_opt, steps, passes, fp16=compression == "fp16")
    assert_close(model, ref, rtol=1e-6)
    if n > 1:      # not the average of the gradients: a run with op="avg" ends elsewhere
        plain = make_model()
        train(plain, ht.DistributedOptimizer(make_opt(plain), op="avg", backward_passes_per_step=passes))
        assert (flat_params(plain) - flat_params(model)).abs().max() > 1e-4
    with pytest.raises(ValueError, match="summing compressor"):
        ht.DistributedOptimizer(make_opt(make_model()), op="adasum", compression="topk")
