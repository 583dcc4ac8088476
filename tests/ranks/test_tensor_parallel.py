"""Tensor-parallel layers train exactly like the single-process layers they were sharded from.

tp = N (and dp=2 x tp=2 at 4 ranks): an attention block (12 heads) followed by
an MLP block, sharded with ``from_linears`` from the same ``nn.Linear`` layers
a single process trains; after 10 SGD steps every shard equals its slice of
the reference within 1e-5 relative, the losses agree each step, and the
tensor-parallel ranks hold identical outputs.  Sizes that do not divide are
refused with the reason.
"""
import hashlib

import pytest
import torch
import torch.nn.functional as F

import hpctrain.torch as ht
from hpctrain.parallel import ParallelLayout

HIDDEN, HEADS, FFN, T, B, STEPS = 24, 12, 48, 5, 4, 10


def reference_layers(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4)] + [torch.nn.Linear(HIDDEN, FFN),
                                                                 torch.nn.Linear(FFN, HIDDEN)]


def reference_forward(layers, x):
    q, k, v, out, fc1, fc2 = layers
    b, t, _ = x.shape

    def split(y):
        return y.view(b, t, HEADS, HIDDEN // HEADS).transpose(1, 2)

    att = F.scaled_dot_product_attention(split(q(x)), split(k(x)), split(v(x)), is_causal=True)
    h = out(att.transpose(1, 2).reshape(b, t, HIDDEN))
    return fc2(F.gelu(fc1(h)))


def data(step, replica):
    g = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(B, T, HIDDEN, generator=g), torch.randn(B, T, HIDDEN, generator=g)


def layouts(n):
    return [(1, n)] + ([(2, 2)] if n == 4 else [])


@pytest.mark.parametrize("wrapper", ["plain", "zero2", "local-sgd"])
def test_attention_and_mlp_blocks_train_like_one_process(comm, wrapper):
    """The tensor-parallel blocks inside data parallelism; ``zero2``: the optimizer state and gradients sharded
    over the data-parallel group (ZeRO stage 2), the tensor-parallel ranks each holding their own; ``local-sgd``:
    LocalSGDOptimizer over the data-parallel group, parameters averaged every step (equal to synchronous SGD)."""
    for dp, tp in layouts(comm.size):
        layout = ParallelLayout(dp=dp, tp=tp, comm=comm)
        tpc = layout.tp_comm
        ref = reference_layers()
        ref_params = [p for m in ref for p in m.parameters()]
        ref_opt = torch.optim.SGD(ref_params, lr=0.05)
        shard = reference_layers()
        model = torch.nn.Sequential(ht.ParallelSelfAttention.from_linears(*shard[:4], heads=HEADS, tp_comm=tpc,
                                                                          causal=True),
                                    ht.ParallelMLP.from_linears(shard[4], shard[5], tpc))
        sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = (ht.ShardedOptimizer(sgd, stage=2, comm=layout.dp_comm) if wrapper == "zero2" else
               ht.LocalSGDOptimizer(sgd, sync_every=1, comm=layout.dp_comm) if wrapper == "local-sgd" else
               ht.DistributedOptimizer(sgd, comm=layout.dp_comm))
        replica = layout.coords["dp"]
        for step in range(STEPS):
            x, y = data(step, replica)
            opt.zero_grad()
            out = model(x)
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            digest = hashlib.sha256(out.detach().numpy().tobytes()).hexdigest()
            assert len(set(tpc.allgather_object(digest))) == 1, "tensor-parallel ranks disagree on the output"
            xs, ys = zip(*(data(step, k) for k in range(dp)))
            with torch.no_grad():
                want = F.mse_loss(reference_forward(ref, x), y)
            ref_opt.zero_grad()
            F.mse_loss(reference_forward(ref, torch.cat(xs)), torch.cat(ys)).backward()
            ref_opt.step()
            assert abs(float(loss) - float(want)) <= 1e-5 * float(want), (step, float(loss), float(want))
        r, t = tpc.rank, tpc.size
        pairs = []
        for name, full in zip(("q", "k", "v"), ref[:3]):
            part = getattr(model[0], name)
            rows = slice(r * HIDDEN // t, (r + 1) * HIDDEN // t)
            pairs += [(part.weight, full.weight[rows]), (part.bias, full.bias[rows])]
        pairs += [(model[0].out.weight, ref[3].weight[:, r * HIDDEN // t:(r + 1) * HIDDEN // t]),
                  (model[0].out.bias, ref[3].bias),
                  (model[1].fc1.weight, ref[4].weight[r * FFN // t:(r + 1) * FFN // t]),
                  (model[1].fc1.bias, ref[4].bias[r * FFN // t:(r + 1) * FFN // t]),
                  (model[1].fc2.weight, ref[5].weight[:, r * FFN // t:(r + 1) * FFN // t]),
                  (model[1].fc2.bias, ref[5].bias)]
        for got, want in pairs:
            err = float((got.detach() - want.detach()).abs().max() / want.detach().abs().max())
            assert err <= 1e-5, f"dp={dp} tp={tp}: relative error {err:.3g}"
        layout.free()


def test_column_gather_and_row_scatter_round_trip(comm):
    """gather_output and input_is_parallel=False give the full layer's output and gradients."""
    torch.manual_seed(3)
    a, b = torch.nn.Linear(8, 12), torch.nn.Linear(12, 8)
    x = torch.randn(3, 8, requires_grad=True)
    if 12 % comm.size:
        pytest.skip("12 features do not split over this many ranks")
    col = ht.ColumnParallelLinear.from_linear(a, comm, gather_output=True)
    row = ht.RowParallelLinear.from_linear(b, comm, input_is_parallel=False)
    y = row(col(x))
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    want = b(a(x2))
    want.sum().backward()
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6) and torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_sizes_that_do_not_divide_are_refused(comm):
    if comm.size == 1:
        pytest.skip("everything divides by one")
    with pytest.raises(ValueError, match=f"out_features = {comm.size + 1} is not divisible by the {comm.size}"):
        ht.ColumnParallelLinear(4, comm.size + 1, comm)
    with pytest.raises(ValueError, match=f"heads = {comm.size + 1} is not divisible"):
        ht.ParallelSelfAttention(comm.size + 1, comm.size + 1, comm)


def test_adasum_over_tensor_parallel_slices_is_refused_in_one_line(comm):
    """Adasum's dot products over a slice are not the whole tensor's: refused, naming a sliced parameter."""
    layout = ParallelLayout(dp=1, tp=comm.size, comm=comm)
    model = ht.ParallelMLP.from_linears(*reference_layers()[4:], layout.tp_comm)
    make = lambda: ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),    # noqa: E731
                                           named_parameters=model.named_parameters(), comm=layout.dp_comm,
                                           op="adasum")
    if comm.size == 1:
        make()          # (a group of one splits nothing)
    else:
        with pytest.raises(ValueError, match=r"op='adasum' combines whole tensors by their dot products, and "
                                             r"'fc1.weight' is a slice of one split over a tensor-parallel group "
                                             r"\(3 such parameters\).*use op='avg'"):
            make()
    layout.free()
