"""Process layouts and pipeline-parallel PyTorch training against one process training the whole model.

Layouts: every factorisation of this launch's size into dp x pp x tp, in two
orders, against the documented mixed-radix formula and the groups the
sub-communicators really hold.  Pipelines: pp = N stages (and dp=2 x pp=2 at
4 ranks), GPipe and 1F1B, micro-batch counts 1, 2 and 3 (3 leaves a
remainder: a batch of 8 becomes 3+3+2); after 10 steps of SGD with momentum
the stage's parameters equal the same layers of a single-process model
trained on the data-parallel replicas' batches concatenated, within 1e-5
relative, and the loss each step equals the reference loss of the replica's
batch.  A stage whose input shape does not fit makes every rank raise.
"""
import itertools

import numpy as np
import pytest
import torch

import hpctrain.torch as ht
from hpctrain.parallel import ParallelLayout

B, STEPS = 8, 10


def factorisations(n):
    return [(dp, pp, tp) for dp, pp, tp in itertools.product(range(1, n + 1), repeat=3) if dp * pp * tp == n]


@pytest.mark.parametrize("order", ["tp-pp-dp", "dp-pp-tp"])
def test_layout_coordinates_and_groups_follow_the_formula(comm, order):
    n, r = comm.size, comm.rank
    axes = order.split("-")
    for dp, pp, tp in factorisations(n):
        sizes = {"dp": dp, "pp": pp, "tp": tp}
        layout = ParallelLayout(dp=dp, pp=pp, tp=tp, order=order, comm=comm)
        want = {axes[0]: r % sizes[axes[0]], axes[1]: r // sizes[axes[0]] % sizes[axes[1]],
                axes[2]: r // (sizes[axes[0]] * sizes[axes[1]])}
        assert layout.coords == want
        assert layout.rank_of(**layout.coords) == r
        for axis in ("dp", "pp", "tp"):
            sub = layout.comm_of(axis)
            members = sub.allgather_object(r)
            assert members == layout.group(axis), (axis, members, layout.group(axis))
            assert sub.rank == layout.coords[axis] and sub.size == sizes[axis]
            others = {a: c for a, c in layout.coords.items() if a != axis}
            assert all({a: c for a, c in layout.coords_of(m).items() if a != axis} == others for m in members)
        layout.free()


def test_bad_layouts_are_refused_with_the_reason(comm):
    n = comm.size
    with pytest.raises(ValueError, match=rf"dp\*pp\*tp = {n}\*2\*1 = {2 * n} ranks, but the communicator"):
        ParallelLayout(dp=n, pp=2, comm=comm)
    with pytest.raises(ValueError, match="unknown: \\['ep'\\]"):
        ParallelLayout(dp=n, order="tp-ep-dp", comm=comm)
    with pytest.raises(ValueError, match="must name each of dp, pp, tp once"):
        ParallelLayout(dp=n, order="tp-tp-dp", comm=comm)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        ParallelLayout(dp=n, pp=0, comm=comm)


def make_model(seed=0):
    """Five blocks with parameters, so every split into up to 5 stages gives each stage some."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(6 if i == 0 else 16, 16), torch.nn.Tanh()) for i in range(4)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(16, 3))


def batch(step, replica):
    g = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(B, 6, generator=g), torch.randint(0, 3, (B,), generator=g)


def layouts(n):
    out = [(1, n)] if n <= 5 else []
    if n == 4:
        out.append((2, 2))
    return out


# (one micro-batch makes GPipe and 1F1B the same list of actions, F0 B0 on every stage: tests/test_pipeline_schedule.py)
@pytest.mark.parametrize("m, schedule", [(1, "gpipe"), (2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b")])
def test_pipeline_training_equals_one_process(comm, schedule, m):
    for dp, pp in layouts(comm.size):
        layout = ParallelLayout(dp=dp, pp=pp, comm=comm)
        reference = make_model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        pipe = ht.Pipeline(make_model(), layout, micro_batches=m, schedule=schedule)
        opt = ht.DistributedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9),
                                      comm=layout.dp_comm)
        replica = layout.coords["dp"]
        for step in range(STEPS):
            x, y = batch(step, replica)
            opt.zero_grad()
            loss = pipe.train_step(x, y, optimizer=opt)
            opt.step()
            xs, ys = zip(*(batch(step, k) for k in range(dp)))
            ref_opt.zero_grad()
            with torch.no_grad():
                want_loss = torch.nn.functional.cross_entropy(reference(x), y)
            torch.nn.functional.cross_entropy(reference(torch.cat(xs)), torch.cat(ys)).backward()
            ref_opt.step()
            assert abs(float(loss) - float(want_loss)) <= 1e-5 * abs(float(want_loss)), (step, loss, want_loss)
        assert_stage_equals(pipe, reference, layout, pp, f"dp={dp} pp={pp} {schedule} m={m}", tolerance=1e-5)
        x, _ = batch(STEPS, replica)
        with torch.no_grad():
            want_out = reference(x)
        got_out = pipe.infer(x)
        assert float((got_out - want_out).abs().max() / want_out.abs().max()) <= 1e-5
        peak = pipe.peak_in_flight
        first = layout.stage == 0 and pp > 1
        assert peak == (m if schedule == "gpipe" else min(m, pp - layout.stage + first)), peak
        layout.free()


def test_balance_by_parameter_count():
    layers = [torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 100), torch.nn.Linear(100, 10),
              torch.nn.Linear(10, 10)]
    assert ht.pipeline.balance_by_parameters(layers, 2) == [3, 2]     # 110+0+1100 | 1010+110
    assert ht.pipeline.balance_by_parameters(layers, 5) == [1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="cannot split 5 layers into 6"):
        ht.pipeline.balance_by_parameters(layers, 6)


def test_a_stage_that_does_not_fit_makes_every_rank_raise(comm):
    """Stage 1 expects 7 features where stage 0 sends 16: every rank raises PipelineError naming stage 1."""
    if comm.size < 2:
        pytest.skip("needs two pipeline stages")
    layout = ParallelLayout(pp=comm.size, comm=comm)
    stages = [torch.nn.Linear(6, 16)] + [torch.nn.Linear(7, 16)] + \
        [torch.nn.Linear(16, 16) for _ in range(comm.size - 3)] + ([torch.nn.Linear(16, 3)] if comm.size > 2 else [])
    stages[-1] = torch.nn.Linear(7 if comm.size == 2 else 16, 3)
    pipe = ht.Pipeline(stages, layout, micro_batches=2, schedule="1f1b")
    x, y = batch(0, 0)
    with pytest.raises(ht.PipelineError, match=r"stage 1 \(rank 1\) failed in F of micro-batch 0: RuntimeError"):
        pipe.train_step(x, y)
    with pytest.raises(ValueError, match="got 1 stage modules for a pipeline"):
        ht.Pipeline([torch.nn.Linear(2, 2)], layout, micro_batches=1)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        ht.Pipeline(stages, layout, micro_batches=1, schedule="zigzag")


def test_shapes_travel_once_and_only_the_first_dimension_may_change(comm):
    """Later steps send bytes alone: other micro-batch sizes work; a new row shape is refused on every rank."""
    if comm.size < 2:
        pytest.skip("needs two pipeline stages")
    layout = ParallelLayout(pp=comm.size, comm=comm)
    torch.manual_seed(3)
    stages = [torch.nn.Identity()] + [torch.nn.Linear(6, 6) for _ in range(comm.size - 2)] + [torch.nn.Linear(6, 3)]
    reference = torch.nn.Sequential(*stages[1:])
    pipe = ht.Pipeline(stages, layout, micro_batches=3, schedule="1f1b")
    for size in (8, 5, 9):                     # micro-batches of 3,3,2 then 2,2,1 then 3,3,3 rows
        x, y = batch(size, 0)
        x, y = x[:size], y[:size]
        with torch.no_grad():
            want = torch.nn.functional.cross_entropy(reference(x), y)
        got = pipe.train_step(x, y)
        assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (size, got, want)
        assert [type(v) for v in pipe.links._sent.values()] == [tuple] * len(pipe.links._sent)
    with pytest.raises(ht.PipelineError, match=r"stage 0 \(rank 0\) failed in F of micro-batch 0: ValueError: "
                                               r"stage 0: a activation of rows \(1, 6\) float32 for stage 1, but the "
                                               r"first step sent rows \(6,\) float32"):
        pipe.train_step(x.reshape(len(x), 1, 6), y)



@pytest.mark.parametrize("wrapper", ["zero1", "zero2", "local-sgd"])
def test_sharded_and_local_sgd_optimizers_over_the_data_parallel_group_equal_one_process(comm, wrapper):
    """ShardedOptimizer (stage 1, 2) and LocalSGDOptimizer (averaging every step) over ``layout.dp_comm``, passed
    to ``train_step``: the micro-batches' gradients are accumulated and averaged once a step, as one process
    training on every replica's batch at once (float64)."""
    for dp, pp in layouts(comm.size):
        layout = ParallelLayout(dp=dp, pp=pp, comm=comm)
        reference = make_model().double()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        pipe = ht.Pipeline(make_model().double(), layout, micro_batches=2, schedule="1f1b")
        sgd = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        opt = (ht.LocalSGDOptimizer(sgd, sync_every=1, comm=layout.dp_comm) if wrapper == "local-sgd" else
               ht.ShardedOptimizer(sgd, stage=int(wrapper[-1]), comm=layout.dp_comm))
        for step in range(STEPS):
            x, y = batch(step, layout.coords["dp"])
            opt.zero_grad()
            pipe.train_step(x.double(), y, optimizer=opt)
            opt.step()
            xs, ys = zip(*(batch(step, k) for k in range(dp)))
            ref_opt.zero_grad()
            torch.nn.functional.cross_entropy(reference(torch.cat(xs).double()), torch.cat(ys)).backward()
            ref_opt.step()
        assert_stage_equals(pipe, reference, layout, pp, f"{wrapper} dp={dp} pp={pp}")
        layout.free()


def assert_stage_equals(pipe, reference, layout, pp, what, tolerance=1e-9):
    """This stage's parameters equal its layers' in ``reference`` (relative to the largest)."""
    counts = ht.pipeline.balance_by_parameters(list(make_model()), pp)
    start = sum(counts[:layout.stage])
    want = torch.cat([p.detach().reshape(-1) for p in
                      torch.nn.Sequential(*list(reference)[start:start + counts[layout.stage]]).parameters()])
    got = torch.cat([p.detach().reshape(-1) for p in pipe.parameters()])
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= tolerance, f"{what}: relative error {err:.3g}"


def adasum_pair(a, b):
    """Adasum of two deltas (Maleki et al. 2021): each scaled down by half its projection onto the other."""
    dot = float(np.dot(a.ravel(), b.ravel()))
    na, nb = float(np.dot(a.ravel(), a.ravel())), float(np.dot(b.ravel(), b.ravel()))
    return (1 - dot / (2 * na) if na else 1) * a + (1 - dot / (2 * nb) if nb else 1) * b


def test_adasum_over_the_data_parallel_group_combines_each_stages_whole_tensors(comm):
    """op='adasum' over ``layout.dp_comm``: a stage holds whole layers, so Adasum tensor by tensor over the
    data-parallel group equals Adasum of the whole model's replicas (each its own momentum, its own batch) in one
    process (float64; at dp = 1 the replica's own step)."""
    for dp, pp in layouts(comm.size):
        layout = ParallelLayout(dp=dp, pp=pp, comm=comm)
        replicas = [make_model().double() for _ in range(dp)]
        ref_opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]
        pipe = ht.Pipeline(make_model().double(), layout, micro_batches=2, schedule="1f1b")
        opt = ht.DistributedOptimizer(torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9),
                                      comm=layout.dp_comm, op="adasum")
        for step in range(STEPS):
            x, y = batch(step, layout.coords["dp"])
            opt.zero_grad()
            pipe.train_step(x.double(), y, optimizer=opt)
            opt.step()
            starts, deltas = [], []
            for k, (m, o) in enumerate(zip(replicas, ref_opts)):
                start = [p.detach().clone() for p in m.parameters()]
                xk, yk = batch(step, k)
                o.zero_grad()
                torch.nn.functional.cross_entropy(m(xk.double()), yk).backward()
                o.step()
                starts.append(start)
                deltas.append([(p.detach() - s).numpy() for p, s in zip(m.parameters(), start)])
            if dp == 2:
                with torch.no_grad():
                    for m in replicas:
                        for p, s, a, b in zip(m.parameters(), starts[0], deltas[0], deltas[1]):
                            p.copy_(s + torch.from_numpy(adasum_pair(a, b)))
        assert_stage_equals(pipe, replicas[0], layout, pp, f"adasum dp={dp} pp={pp}")
        layout.free()
