"""hpctrain.horovod.torch behaves as Horovod's API promises, checked against numpy and one-process references.

Runs at 1-4 ranks last in the default launch (the negotiation thread must be
the only issuer of collectives while ``hvd`` is initialised: its module
fixture does so only after the other files' tests).  Each test compares with
a reference computed another way: numpy on every rank's input (each rank can
rebuild the others' inputs from the seed), finite differences of a global
loss for gradients, the Adasum formula in numpy, and a single process
training on the concatenated batch for DistributedOptimizer.
"""
import itertools

import numpy as np
import pytest
import torch

import hpctrain.horovod.torch as hvd
from hpctrain.collectives.adasum import adasum_reference


pytestmark = pytest.mark.usefixtures("horovod_api")


def t(a):
    return torch.from_numpy(np.array(a))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.float32, np.float64])
def test_allreduce_ops_and_scale_factors(dtype, inputs):
    xs = inputs((5, 3), dtype, seed=1)
    x = t(xs[hvd.rank()])
    stack = np.stack(xs)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum).numpy(), stack.sum(0))
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Min).numpy(), stack.min(0))
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Max).numpy(), stack.max(0))
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Product).numpy(), stack.prod(0))
    avg = hvd.allreduce(x).numpy()             # Average is the default
    if np.dtype(dtype).kind == "i":
        want = np.trunc(stack.sum(0).astype(np.float64) / hvd.size()).astype(dtype)
        np.testing.assert_array_equal(avg, want)
    else:
        np.testing.assert_allclose(avg, stack.mean(0), rtol=1e-6)
    pre = (stack.astype(np.float64) * 0.37).astype(dtype).sum(0)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.37).numpy()
    np.testing.assert_allclose(got, pre, rtol=1e-6)
    post = (stack.sum(0).astype(np.float64) * 1.5).astype(dtype)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, postscale_factor=1.5).numpy(), post, rtol=1e-6)


def test_requests_match_by_name_not_by_order():
    a, b = torch.full((4,), float(hvd.rank())), torch.full((7,), 2.0 * hvd.rank())
    order = [("a", a), ("b", b)] if hvd.rank() % 2 == 0 else [("b", b), ("a", a)]
    handles = {name: hvd.allreduce_async(x, name=name, op=hvd.Sum) for name, x in order}
    total = sum(range(hvd.size()))
    assert torch.equal(hvd.synchronize(handles["a"]), torch.full((4,), float(total)))
    assert torch.equal(hvd.synchronize(handles["b"]), torch.full((7,), 2.0 * total))


def test_open_request_across_a_barrier_and_duplicate_names():
    x = torch.ones(3)
    if hvd.rank() == 0:
        h = hvd.allreduce_async(x, name="late", op=hvd.Sum)
        if hvd.size() > 1:      # (alone, the request may finish before the second call; here the others wait)
            with pytest.raises(ValueError, match="still in flight"):
                hvd.allreduce_async(x, name="late")
    hvd.barrier()
    if hvd.rank() != 0:
        h = hvd.allreduce_async(x, name="late", op=hvd.Sum)
    assert torch.equal(hvd.synchronize(h), torch.full((3,), float(hvd.size())))
    with pytest.raises(ValueError, match="handle"):
        hvd.synchronize(h)


def test_no_cycles_while_nothing_is_open_and_a_rank_with_nothing_to_start_still_takes_part():
    """Doorbells: with nothing open no rank runs negotiation cycles (a training step's forward pass runs
    without them); a request that only some ranks start still completes (the others are rung)."""
    import time
    from hpctrain.horovod.basics import controller
    ctl = controller()
    hvd.barrier()
    time.sleep(0.05)                       # the barrier's last cycle is over on every rank
    before = ctl._cycle
    time.sleep(0.3)
    idle_cycles = ctl._cycle - before
    if ctl._exchange.has_doorbells:
        assert idle_cycles == 0, f"{idle_cycles} cycles in 0.3 s with nothing open"
    else:                                  # timed cycles: at least one per HOROVOD_CYCLE_TIME
        assert idle_cycles > 0
    r, n = hvd.rank(), hvd.size()
    mine = hvd.add_process_set([0]) if n > 1 else hvd.global_process_set
    if r == 0:                  # the others start nothing for a second: they must be rung for its cycle
        start = time.monotonic()
        out = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=mine, name="alone")
        waited = time.monotonic() - start
        assert out.tolist() == [1.0, 1.0] and waited < 0.5, (out, waited)
    else:
        time.sleep(1.0)
    hvd.barrier()
    if n > 1:
        assert hvd.remove_process_set(mine)


def test_ranks_a_few_ms_apart_run_one_cycle_per_request_not_idle_cycles_until_the_last_starts_it():
    """A doorbell for a request every rank starts itself (a training step's gradients, ranks some
    milliseconds apart) lets the later ranks come with their own request: one cycle per request, not a
    cycle without them and idle cycles until they start it (each takes the training thread's core)."""
    import time
    from hpctrain.horovod.basics import controller
    ctl = controller()
    hvd.barrier()
    time.sleep(0.05)                       # nothing open anywhere: every rank waits for a doorbell
    requests, before = 6, ctl._cycle
    for i in range(requests):
        time.sleep(0.01 * hvd.rank())      # rank r starts each request r x 10 ms after rank 0
        out = hvd.allreduce(torch.full((2,), float(i)), op=hvd.Sum, name=f"skewed.{i}")
        assert out.tolist() == [float(i * hvd.size())] * 2
    cycles = ctl._cycle - before
    if ctl._exchange.has_doorbells:
        assert cycles <= 2 * requests, f"{cycles} negotiation cycles for {requests} requests"


def test_a_request_completes_when_its_last_rank_starts_it_not_a_pause_later():
    """Ranks that started a request wait inside the exchange instead of pausing between cycles, so the
    rank that starts it last gets the result at once, however long the others' pauses have grown."""
    import time
    from hpctrain.horovod.basics import controller
    ctl = controller()
    r, n = hvd.rank(), hvd.size()
    hvd.barrier()
    saved, ctl._max_pause = ctl._max_pause, 0.5          # pauses of up to 0.5 s (HOROVOD_CYCLE_TIME=500)
    try:
        if r == n - 1:
            time.sleep(0.8)            # the others' pauses have grown to the maximum meanwhile
        start = time.monotonic()
        out = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name="last.starts")
        waited = time.monotonic() - start
    finally:
        ctl._max_pause = saved
    assert out.tolist() == [float(sum(range(n)))] * 3
    if r == n - 1:
        assert waited < 0.15, f"the last rank waited {waited:.3f} s for a request every other rank had started"
    hvd.barrier()


def test_a_negotiated_handle_honours_wait_timeout_and_finishes_on_a_later_wait():
    """hpctrain.horovod's communicator hands out Waitables too: the others' wait(timeout) raises TimeoutError while
    the last rank has not started the request, and a later wait gives the result."""
    import time
    from hpctrain.comm.call.handle import Waitable
    from hpctrain.horovod.negotiated import NegotiatedComm
    comm = NegotiatedComm()
    r, n = hvd.rank(), hvd.size()
    hvd.barrier()
    if r == n - 1:
        time.sleep(0.5)
    handle = comm.allreduce_async(np.full(4, r + 1.0))
    assert isinstance(handle, Waitable), type(handle)
    if n > 1 and r < n - 1:
        with pytest.raises(TimeoutError, match="still pending"):
            handle.wait(timeout=0.05)
    np.testing.assert_array_equal(handle.wait(timeout=60), np.full(4, n * (n + 1) / 2))
    hvd.barrier()


def test_in_place_and_grouped_forms(inputs):
    xs = inputs((6,), np.float64, seed=2)
    x = t(xs[hvd.rank()])
    assert hvd.allreduce_(x, op=hvd.Sum) is x
    np.testing.assert_allclose(x.numpy(), np.sum(xs, 0))
    zs = inputs((2, 3), np.float32, seed=3)
    n, r = hvd.size(), hvd.rank()
    ys = [t(zs[r]), torch.arange(4, dtype=torch.int64) + r]
    out = hvd.grouped_allreduce(ys, op=hvd.Sum)
    np.testing.assert_allclose(out[0].numpy(), np.sum(zs, 0), rtol=1e-6)
    assert torch.equal(out[1], torch.arange(4) * n + sum(range(n)))
    assert hvd.grouped_allreduce_(ys, op=hvd.Max) == ys
    np.testing.assert_array_equal(ys[0].numpy(), np.max(zs, 0))
    assert torch.equal(ys[1], torch.arange(4) + n - 1)


def test_allgather_broadcast_alltoall_reducescatter(inputs):
    r, n = hvd.rank(), hvd.size()
    rows = [k % 3 + 1 for k in range(n)]
    parts = [np.full((rows[k], 2), k, np.float32) for k in range(n)]
    np.testing.assert_array_equal(hvd.allgather(t(parts[r])).numpy(), np.concatenate(parts))
    g1, g2 = hvd.grouped_allgather([t(parts[r]), torch.tensor([r])])
    assert g2.tolist() == list(range(n))
    for root in range(n):
        assert hvd.broadcast(torch.tensor([r, 2 * r]), root).tolist() == [root, 2 * root]
    splits = [(r + k) % 2 + 1 for k in range(n)]      # rank r sends splits[k] rows to rank k
    send = torch.cat([torch.full((s,), 10 * r + k) for k, s in enumerate(splits)])
    got, received = hvd.alltoall(send, torch.tensor(splits, dtype=torch.int32))
    assert received.tolist() == [(k + r) % 2 + 1 for k in range(n)]
    assert got.tolist() == [10 * k + r for k in range(n) for _ in range((k + r) % 2 + 1)]
    xs = inputs((2 * n + 1, 3), np.float32, seed=4)
    total = np.sum(xs, 0)
    mine = hvd.reducescatter(t(xs[r]), op=hvd.Sum).numpy()
    np.testing.assert_allclose(mine, np.array_split(total, n)[r], rtol=1e-6)


def test_disagreements_fail_on_every_rank_with_the_ranks_named():
    if hvd.size() == 1:
        pytest.skip("one rank cannot disagree with itself")
    r = hvd.rank()
    cases = [lambda: hvd.allreduce(torch.ones(3 + (r == 1))),
             lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32 if r == 1 else torch.float32)),
             lambda: hvd.broadcast(torch.ones(2), root_rank=r),
             lambda: hvd.allgather(torch.ones(2, 2 + (r == 1))),
             lambda: hvd.reducescatter(torch.tensor(1.0))]
    for case in cases:
        with pytest.raises(RuntimeError) as info:
            case()
        assert "rank" in str(info.value)
        texts = hvd.allgather_object(str(info.value))
        assert len(set(texts)) == 1, texts
    with pytest.raises(ValueError, match="int32"):
        hvd.alltoall(torch.ones(hvd.size()), torch.ones(hvd.size()))
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


def test_join_contributes_zeros_and_refuses_gathers():
    r, n = hvd.rank(), hvd.size()
    for first in range(n):
        if r == first:
            last = hvd.join()
        else:
            out = hvd.allreduce(torch.full((3,), float(r + 1)), name=f"j{first}", op=hvd.Sum)
            assert out.tolist() == [float(sum(k + 1 for k in range(n) if k != first))] * 3
            if n > 1:
                with pytest.raises(RuntimeError, match="joined"):
                    hvd.allgather(torch.ones(1))
            last = hvd.join()
        assert hvd.allgather_object(last) == [last] * n
        assert n == 1 or last != first


def test_process_sets():
    r, n = hvd.rank(), hvd.size()
    even = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    odd = hvd.add_process_set([k for k in range(n) if k % 2 == 1]) if n > 1 else None
    mine = even if r % 2 == 0 else odd
    assert mine.included() and mine.rank() == r // 2 and mine.size() == len(mine.ranks)
    out = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=mine)
    assert out.item() == sum(mine.ranks)
    assert hvd.allgather_object(r, process_set=mine) == mine.ranks
    hvd.barrier(process_set=mine)
    for ps in (odd, even):
        if ps is not None:
            assert hvd.remove_process_set(ps)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=mine)


def global_loss(fn, x, weights, scale):
    """scale * sum over ranks of <weights, fn(x)>: the same number on every rank."""
    local = float((fn(x) * weights).sum())
    return scale * hvd.allreduce(torch.tensor([local], dtype=torch.float64), op=hvd.Sum).item()


# (collective, loss scale): each gradient convention is the derivative of scale * (sum of the ranks' losses)
GRADIENT_CASES = {
    "allreduce_sum": (lambda x: hvd.allreduce(x, op=hvd.Sum), lambda n: 1.0),
    "allreduce_avg": (lambda x: hvd.allreduce(x), lambda n: 1.0),
    "allgather": (lambda x: hvd.allgather(x), lambda n: 1.0 / n),
    "broadcast": (lambda x: hvd.broadcast(x, root_rank=hvd.size() - 1), lambda n: 1.0 / n),
    "alltoall": (lambda x: hvd.alltoall(x)[0], lambda n: 1.0),
    "reducescatter_sum": (lambda x: hvd.reducescatter(x, op=hvd.Sum), lambda n: float(n)),
    "reducescatter_avg": (lambda x: hvd.reducescatter(x, op=hvd.Average), lambda n: float(n)),
}


@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_gradients_equal_finite_differences(case):
    fn, scale_of = GRADIENT_CASES[case]
    n, r = hvd.size(), hvd.rank()
    scale = scale_of(n)
    g = np.random.default_rng(7)
    xs = [g.standard_normal((n, 2)) for _ in range(n)]
    x = torch.tensor(xs[r], requires_grad=True)
    y = fn(x)
    weights = torch.tensor(np.random.default_rng(100 + r).standard_normal(tuple(y.shape)))
    (y * weights).sum().backward()
    grad = x.grad.numpy()
    eps, bad = 1e-6, []
    for q, i in itertools.product(range(n), range(xs[0].size)):
        bumped = []
        for sign in (1, -1):
            xb = xs[r].copy()
            if r == q:
                xb.flat[i] += sign * eps
            bumped.append(global_loss(fn, torch.tensor(xb), weights, scale))
        fd = (bumped[0] - bumped[1]) / (2 * eps)
        if r == q and not abs(fd - grad.flat[i]) < 1e-6 * max(1.0, abs(fd)):
            bad.append((i, fd, grad.flat[i]))
    assert not bad, f"{case}: (element, finite difference, autograd) on rank {r}: {bad}"


def test_adasum_matches_the_formula():
    vs = [np.random.default_rng(k).standard_normal(33) for k in range(hvd.size())]
    got = hvd.allreduce(torch.tensor(vs[hvd.rank()]), op=hvd.Adasum).numpy()
    np.testing.assert_allclose(got, adasum_reference(vs), rtol=1e-12, atol=1e-12)
    same = hvd.allreduce(torch.ones(5, dtype=torch.float64), op=hvd.Adasum)
    assert torch.allclose(same, torch.ones(5, dtype=torch.float64))      # equal vectors: their average
    with pytest.raises(RuntimeError, match="floating-point"):
        hvd.allreduce(torch.ones(3, dtype=torch.int32), op=hvd.Adasum)


def test_native_collectives_are_refused_while_horovod_runs():
    import hpctrain
    x = np.ones(2)
    for _ in range(3):      # (the first call plans; a repeated one takes the repeat path, refused all the same)
        for inplace in (False, True):
            with pytest.raises(hpctrain.HpctrainError, match="hvd.shutdown"):
                hpctrain.world().allreduce(x, inplace=inplace)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [hvd.size()] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/ranks/test_cuda.py says how)")
def test_cuda_tensors_keep_their_device_and_train_as_on_the_cpu(inputs):
    n, r = hvd.size(), hvd.rank()
    dev = torch.device("cuda", r % torch.cuda.device_count())
    torch.backends.cuda.matmul.allow_tf32 = False
    xs = inputs((2 * n, 3), np.float32, seed=8)
    x = t(xs[r]).to(dev)
    results = {"avg": hvd.allreduce(x), "sum": hvd.synchronize(hvd.allreduce_async(x, op=hvd.Sum)),
               "scatter": hvd.reducescatter(x, op=hvd.Sum), "gather": hvd.allgather(x[: r + 1]),
               "bcast": hvd.broadcast(x, root_rank=n - 1), "a2a": hvd.alltoall(x)}
    assert all(v.device == dev for v in results.values()), {k: v.device for k, v in results.items()}
    np.testing.assert_allclose(results["avg"].cpu().numpy(), np.mean(xs, 0), rtol=1e-6)
    np.testing.assert_allclose(results["sum"].cpu().numpy(), np.sum(xs, 0), rtol=1e-6)
    np.testing.assert_allclose(results["scatter"].cpu().numpy(), np.sum(xs, 0)[2 * r:2 * r + 2], rtol=1e-6)
    np.testing.assert_array_equal(results["gather"].cpu().numpy(), np.concatenate([xs[q][: q + 1] for q in range(n)]))
    np.testing.assert_array_equal(results["bcast"].cpu().numpy(), xs[n - 1])
    np.testing.assert_array_equal(results["a2a"].cpu().numpy(), np.concatenate([xs[q][2 * r:2 * r + 2] for q in range(n)]))
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Max) is y and y.device == dev
    np.testing.assert_array_equal(y.cpu().numpy(), np.max(xs, 0))
    w = x.clone().requires_grad_()
    hvd.allreduce(w, op=hvd.Sum).sum().backward()
    assert w.grad.device == dev and torch.equal(w.grad.cpu(), torch.full((2 * n, 3), float(n)))

    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(dev)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        batch = [torch.from_numpy(b) for b in inputs((4, 3), np.float32, seed=20 + step, low=-2, high=2)]
        opt.zero_grad()
        model(batch[r].to(dev)).pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(torch.cat(batch)).pow(2).mean().backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.device == dev
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_timeline_has_a_row_per_tensor_named_as_horovod_names_them(tmp_path_factory):
    # Before, a DistributedOptimizer's reductions were rows call.noname.0.N, one per bucket; Horovod shows
    # allreduce.<parameter name> for every tensor.
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("hvd-timeline") / "t.json") if hvd.rank() == 0 else None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.start_timeline(path)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(3, 5)).sum().backward()
        opt.step()
    hvd.allreduce(torch.ones(2), name="metric")
    hvd.stop_timeline()
    if hvd.rank() != 0:
        return
    import json
    from collections import Counter
    events = json.load(open(path))
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    seen = Counter((rows[e["pid"]], e["name"], e["ph"]) for e in events if e["ph"] != "M")
    import hpctrain
    on_horovod = hpctrain.world().backend == "horovod"      # (Horovod reduces the buckets by name there)
    params = [f"allreduce.{n}" for n, _ in model.named_parameters()] if hvd.size() > 1 else []  # (1: nothing sent)
    assert sorted(set(rows.values())) == sorted(params + ["metric"]), rows
    for row in params + ["metric"]:
        direct = row != "metric" and on_horovod
        runs = 2 if row != "metric" else 1
        assert (seen[(row, "NEGOTIATE_ALLREDUCE", "B")] == 0) == direct, (row, seen)
        if direct:
            assert seen[(row, "HOROVOD_ALLREDUCE", "B")] == runs, (row, seen)
        assert seen[(row, "ALLREDUCE", "B")] == seen[(row, "ALLREDUCE", "E")] == runs, (row, seen)
        if not direct:      # negotiated by hpctrain.horovod: negotiation span, a mark per rank, the backend's op
            assert seen[(row, "NEGOTIATE_ALLREDUCE", "B")] == seen[(row, "NEGOTIATE_ALLREDUCE", "E")] == runs
            assert all(seen[(row, str(r), "X")] == runs for r in range(hvd.size())), (row, seen)
            assert sum(v for (r, name, ph), v in seen.items() if r == row and name.endswith("_ALLREDUCE") and
                       not name.startswith("NEGOTIATE")
                       and ph == "B") == runs


@pytest.mark.parametrize("case", ["sgd_momentum", "adamw_fp16"])
def test_distributed_optimizer_with_adasum_combines_deltas(case):
    """Horovod's ``DistributedOptimizer(op=hvd.Adasum)``: a local step, then Adasum of the parameter deltas
    (the reference: n replicas simulated in one process, numpy Adasum per tensor)."""
    import torch.nn.functional as F
    from test_torch_training import batches, flat_params, make_model, adasum_reference_run
    make_opt = {"sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                "adamw_fp16": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)}[case]
    compression = hvd.Compression.fp16 if case.endswith("fp16") else hvd.Compression.none
    n, r = hvd.size(), hvd.rank()
    model = make_model()
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(), op=hvd.Adasum,
                                   compression=compression)
    for step in range(3):
        opt.zero_grad()
        x, y = batches(step, n)[r]
        F.cross_entropy(model(x), y).backward()
        opt.step()
    want = flat_params(adasum_reference_run(n, make_opt, 3, fp16=case.endswith("fp16")))
    got = flat_params(model).double()
    assert ((got - want.double()).abs().max() / want.abs().max()).item() <= 1e-6
    digests = hvd.allgather_object(got.numpy().tobytes())
    assert all(d == digests[0] for d in digests)
    with pytest.raises(ValueError, match="summing compressor"):
        hvd.DistributedOptimizer(make_opt(make_model()), op=hvd.Adasum, compression=hvd.Compression.hpctrain("topk"))


def test_a_rank_leaving_a_loop_early_costs_its_peers_one_error_not_a_hang():
    """The last rank leaves a loop of unnamed allreduces after one iteration and, after unwinding (as a test
    that fails half-way does), waits in a barrier, while the others wait in the loop's next allreduce: every
    rank waits on a request that cannot complete.  Within seconds the loop's allreduce (the older request)
    fails on the ranks that started it, naming the deadlock, and afterwards unnamed allreduces match again."""
    import time
    from hpctrain.errors import CollectiveMismatchError
    n, r = hvd.size(), hvd.rank()
    if n < 2:
        pytest.skip("needs ranks on both sides of the deadlock")
    started, error = time.monotonic(), None
    try:
        for i in range(3):
            if r == n - 1 and i == 1:
                time.sleep(0.5)            # (reporting the error that ended its loop)
                break
            hvd.allreduce(torch.ones(3), op=hvd.Sum)
    except CollectiveMismatchError as exc:
        error = exc
    hvd.barrier()
    assert time.monotonic() - started < 30
    if r == n - 1:
        assert error is None
    else:
        assert error is not None and "deadlock" in str(error) and f"not by rank {n - 1}" in str(error), error
    got = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum)
    assert got.tolist() == [float(sum(range(n)))] * 2


def test_a_horovod_style_checkpoint_resumes_at_the_same_and_another_size_and_into_a_plain_optimizer(tmp_path):
    """Horovod's recipe: rank 0 saves the model's and the optimizer's ``state_dict`` (torch.save); a restart loads
    it on rank 0 and broadcasts both.  Adam in float64, saved after 3 of 6 steps: resumed at the same size it ends
    bit for bit where the unbroken run does; resumed over a process set of n - 1 ranks (another size) and in a
    plain torch Adam on the whole batch (another wrapper) it ends where one-process Adam on the ranks' averaged
    gradients through the same sizes does."""
    import torch.nn.functional as F
    from test_torch_training import batches, flat_params, make_model
    n, r = hvd.size(), hvd.rank()
    path = hvd.broadcast_object(str(tmp_path / "checkpoint.pt"), root_rank=0)

    def adam(model):
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    def train(model, opt, steps, size, rank):
        for step in steps:
            opt.zero_grad()
            x, y = batches(step, size)[rank] if rank is not None else map(torch.cat, zip(*batches(step, size)))
            F.cross_entropy(model(x.double()), y).backward()
            opt.step()

    def reference(sizes):
        """One process: Adam on the mean of the ``size`` ranks' gradients, for each (steps, size) in turn."""
        model = make_model().double()
        opt = adam(model)
        for steps, size in sizes:
            for step in steps:
                opt.zero_grad()
                grads = []
                for x, y in batches(step, size):
                    model.zero_grad()
                    F.cross_entropy(model(x.double()), y).backward()
                    grads.append([p.grad.clone() for p in model.parameters()])
                for i, p in enumerate(model.parameters()):
                    p.grad = sum(g[i] for g in grads) / size
                opt.step()
        return flat_params(model)

    def resumed(size, process_set=hvd.global_process_set):
        model = make_model(seed=7).double()         # (other weights: the checkpoint must bring them)
        opt = hvd.DistributedOptimizer(adam(model), named_parameters=model.named_parameters(),
                                       process_set=process_set)
        if r == 0:
            saved = torch.load(path, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0, process_set=process_set)
        hvd.broadcast_optimizer_state(opt, root_rank=0, process_set=process_set)
        train(model, opt, range(3, 6), size, r)
        return flat_params(model)

    model = make_model().double()
    opt = hvd.DistributedOptimizer(adam(model), named_parameters=model.named_parameters())
    train(model, opt, range(3), n, r)
    if r == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    hvd.barrier()
    train(model, opt, range(3, 6), n, r)
    unbroken = flat_params(model)
    assert torch.equal(resumed(n), unbroken)
    m = max(1, n - 1)
    smaller = hvd.add_process_set(list(range(m))) if m < n else hvd.global_process_set
    if r < m:
        got = resumed(m, smaller)
        want = reference([(range(3), n), (range(3, 6), m)])
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-12
    if smaller is not hvd.global_process_set:
        hvd.barrier()
        assert hvd.remove_process_set(smaller)
    plain = make_model(seed=7).double()
    plain_opt = adam(plain)
    saved = torch.load(path, weights_only=True)
    plain.load_state_dict(saved["model"])
    plain_opt.load_state_dict(saved["optimizer"])
    train(plain, plain_opt, range(3, 6), n, None)
    assert float((flat_params(plain) - unbroken).abs().max() / unbroken.abs().max()) <= 1e-12
