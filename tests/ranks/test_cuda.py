"""CUDA tensors through hpctrain's torch paths: the CPU path's results, on the tensor's own device.

Skipped without a GPU (CI runs on CPUs).  On a GPU machine::

    mpirun -n N python -m pytest tests/ranks/test_cuda.py

(rank r uses device r % device_count, so ranks may share one GPU).  The
references are independent of the CUDA path: numpy on every rank's input,
and single-process training on the CPU with the batches of all ranks.
"""
import copy
import hashlib
import shutil
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import hpctrain.torch as ht
from hpctrain.checkpoint import CheckpointManager, RNGState, Sharded
from hpctrain.parallel import ParallelLayout
from test_torch_training import B, batches, flat_params, make_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.uint8]


@pytest.fixture(scope="module")
def dev(comm):
    """This rank's GPU; TF32 off so that CUDA and CPU arithmetic agree to float32 rounding."""
    d = torch.device("cuda", comm.rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return d


def values(rank, rows):
    """Small integers (exact in every dtype, uint8 sums included at 4 ranks), different per rank."""
    return (np.arange(rows * 2).reshape(rows, 2) % 5 + rank) % 7


def as_np(t):
    return t.double().numpy()


def reference(tensors, op):
    stacked = np.stack([as_np(t) for t in tensors])
    return {"sum": stacked.sum, "max": stacked.max}[op](axis=0)


def on_device(t, dev, dtype):
    assert isinstance(t, torch.Tensor) and t.device == dev and t.dtype == dtype, (t.device, t.dtype)
    return t.cpu()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_collectives_give_cuda_tensors_with_the_numpy_result(comm, dev, dtype):
    n, r = comm.size, comm.rank
    x = torch.from_numpy(values(r, 2 * n)).to(dtype).to(dev)
    red = [torch.from_numpy(values(q, 2 * n)).to(dtype) for q in range(n)]
    np.testing.assert_array_equal(as_np(on_device(comm.allreduce(x, op="sum"), dev, dtype)),
                                  reference(red, "sum"))
    np.testing.assert_array_equal(as_np(on_device(comm.allreduce(x, op="max"), dev, dtype)),
                                  reference(red, "max"))
    g = comm.allgather(x[: r + 1])
    np.testing.assert_array_equal(as_np(on_device(g, dev, dtype)),
                                  np.concatenate([as_np(t[: q + 1]) for q, t in enumerate(red)]))
    assert torch.equal(on_device(comm.broadcast(x, root=n - 1), dev, dtype), red[n - 1])
    a = on_device(comm.alltoall(x), dev, dtype)
    np.testing.assert_array_equal(as_np(a), np.concatenate([as_np(t)[2 * r:2 * r + 2] for t in red]))
    rs = on_device(comm.reduce_scatter(x, op="sum"), dev, dtype)
    np.testing.assert_array_equal(as_np(rs), reference(red, "sum")[2 * r:2 * r + 2])
    outs = comm.grouped_allreduce([x, x[:1]], op="sum")
    np.testing.assert_array_equal(as_np(on_device(outs[1], dev, dtype)), reference(red, "sum")[:1])
    y = x.clone()
    assert comm.allreduce(y, op="sum", inplace=True) is y
    np.testing.assert_array_equal(as_np(on_device(y, dev, dtype)), reference(red, "sum"))
    h = comm.allreduce_async(x, op="max")
    np.testing.assert_array_equal(as_np(on_device(h.wait(), dev, dtype)), reference(red, "max"))


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_training_on_cuda_matches_one_cpu_process_with_every_batch(comm, dev, compression):
    n, r = comm.size, comm.rank
    model, ref = make_model(seed=r, bn=True).to(dev), make_model(bn=True)
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  named_parameters=model.named_parameters(), bucket_mb=0.001,
                                  compression=compression)
    ht.broadcast_parameters(model.state_dict(), root=0)
    ht.broadcast_optimizer_state(opt, root=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(8):
        parts = batches(step, n)
        opt.zero_grad()
        # BatchNorm's statistics are per rank: the reference sees each rank's batch on its own.
        F.cross_entropy(model(parts[r][0].to(dev)), parts[r][1].to(dev)).backward()
        opt.step()
        ref_opt.zero_grad()
        loss = sum(F.cross_entropy(ref(x), y) for x, y in parts) / n
        loss.backward()
        ref_opt.step()
        assert all(p.device == dev for p in model.parameters())
        digest = hashlib.sha256(flat_params(model).cpu().numpy().tobytes()).hexdigest()
        assert len(set(comm.allgather_object(digest))) == 1, f"replicas differ after step {step}"
    got, want = flat_params(model).cpu().double(), flat_params(ref).double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= (1e-4 if compression is None else 2e-2), err


def test_sync_batchnorm_on_cuda_equals_batchnorm_on_the_whole_batch(comm, dev):
    n, r = comm.size, comm.rank
    torch.manual_seed(5)
    x = torch.randn(n * B, 3, 4, 4, dtype=torch.float64)
    bn = torch.nn.BatchNorm2d(3).double()
    sbn = ht.SyncBatchNorm(3).double().to(dev)
    mine = x[r * B:(r + 1) * B].to(dev).requires_grad_()
    out = sbn(mine)
    (out * out.detach()).sum().backward()
    ref_in = x.clone().requires_grad_()
    ref = bn(ref_in)
    (ref * ref.detach()).sum().backward()
    torch.testing.assert_close(on_device(out, dev, torch.float64), ref[r * B:(r + 1) * B].detach())
    torch.testing.assert_close(mine.grad.cpu(), ref_in.grad[r * B:(r + 1) * B])
    torch.testing.assert_close(sbn.running_mean.cpu(), bn.running_mean)
    torch.testing.assert_close(sbn.running_var.cpu(), bn.running_var)


def test_checkpoint_round_trip_keeps_cuda_state_and_its_device(comm, dev):
    model = make_model().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        x, y = batches(step, 1)[0]
        F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        opt.step()
    want_model, want_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    torch.cuda.manual_seed(77 + comm.rank)
    path = comm.broadcast_object(tempfile.mkdtemp(prefix="hpctrain-cuda-") if comm.rank == 0 else None)
    try:
        manager = CheckpointManager(path, async_save=True)
        manager.save(3, {"model": model, "opt": opt, "rng": Sharded(RNGState())})
        draws = torch.rand(4, device=dev)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        opt.state[next(iter(opt.state))]["exp_avg"].zero_()
        torch.rand(9, device=dev)
        assert manager.restore({"model": model, "opt": opt, "rng": Sharded(RNGState())}) == 3
        manager.close()
        for k, v in want_model.items():
            assert model.state_dict()[k].device == v.device and torch.equal(model.state_dict()[k], v), k
        for i, s in want_opt["state"].items():
            for k, v in s.items():
                got = opt.state_dict()["state"][i][k]
                assert got.device == v.device and torch.equal(got, v), (i, k)
        assert torch.equal(torch.rand(4, device=dev), draws), "the CUDA generator was not restored"
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def test_pipeline_stages_on_cuda_train_as_one_cpu_process(comm, dev):
    """pp = every rank, 1F1B, 3 micro-batches: stages on the GPU, messages through host memory."""
    from test_pipeline import batch, make_model as pipeline_model
    layout = ParallelLayout(pp=comm.size, comm=comm)
    pipe = ht.Pipeline(pipeline_model(), layout, micro_batches=3, schedule="1f1b")
    pipe.stage_module.to(dev)
    reference = pipeline_model()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        x, y = batch(step, 0)
        opt.zero_grad()
        loss = pipe.train_step(x.to(dev) if pipe.first else None, y.to(dev) if pipe.last else None)
        opt.step()
        ref_opt.zero_grad()
        want = F.cross_entropy(reference(x), y)
        want.backward()
        ref_opt.step()
        assert abs(float(loss) - want.item()) <= 1e-5 * abs(want.item()), (step, float(loss), want.item())
    x, _ = batch(9, 0)
    out = pipe.infer(x.to(dev) if pipe.first else None)
    with torch.no_grad():
        want = reference(x)
    got = on_device(out, dev, torch.float32)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    layout.free()


def test_step_metrics_and_timeline_of_a_cuda_model_record_gpu_use_and_every_span(comm, dev):
    """track_steps + trace_forward + the timeline on a CUDA model: per-rank GPU memory, the torch spans."""
    import json
    import os

    from hpctrain.observe import write_trace

    folder = comm.broadcast_object(tempfile.mkdtemp(prefix="hpctrain-cuda-obs-") if comm.rank == 0 else None)
    try:
        model = make_model().to(dev)
        opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters())
        metrics = ht.track_steps(opt, log_dir=folder, samples_per_step=B, interval=2, resource_interval_s=0.0)
        hooks = ht.trace_forward(model)
        comm.timeline.start()
        for step in range(4):
            x, y = batches(step, comm.size)[comm.rank]
            opt.zero_grad()
            F.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
            opt.step()
        comm.timeline.stop()
        metrics.close()
        for h in hooks:
            h.remove()
        assert metrics.step == 4
        written = write_trace(comm, os.path.join(folder, "trace.json"))
        comm.timeline.clear()
        if comm.rank != 0:
            return
        with open(os.path.join(folder, "ranks.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        assert sorted({r["rank"] for r in rows}) == list(range(comm.size)) and len(rows) == 2 * comm.size
        for row in rows:
            # the model and its gradients live on the GPU (NaN, written as null, would mean not sampled)
            mem, util = row["gpu_memory_bytes"], row["gpu_util_percent"]
            assert mem is not None and mem >= 2 * sum(p.numel() * 4 for p in model.parameters()), row
            assert util is None or 0.0 <= util <= 100.0, row    # None: no NVML on this machine
        with open(written) as f:
            events = json.load(f)["traceEvents"]
        for r in range(comm.size):
            names = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == r and e["cat"] == "torch"]
            for name in ("forward", "backward", "synchronize gradients", "optimizer step"):
                assert names.count(name) == 4, (r, name, names)
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
