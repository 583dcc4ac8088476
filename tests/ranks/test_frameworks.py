"""Torch and TensorFlow tensors go through every collective and come back with their type, dtype and shape."""
import numpy as np
import pytest
import tensorflow as tf
import torch

from hpctrain.tensors import BFLOAT16

TORCH = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64,
         torch.uint8, torch.bool]
TF = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8, tf.bool]


def values(rank, count, width=2):
    """Small integers (exact in every dtype), different per rank."""
    return (np.arange(count * width).reshape(count, width) % 5 + rank) % 7


def reference(tensors, op, wraps_at_256):
    """Return the numpy reduction of every rank's tensor (uint8 sums wrap around as uint8 does)."""
    stacked = np.stack([as_np(t) for t in tensors])
    ref = {"sum": stacked.sum, "min": stacked.min, "max": stacked.max}[op](axis=0)
    return ref % 256 if wraps_at_256 else ref


def as_np(t):
    if isinstance(t, torch.Tensor):
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy().astype(np.float64)
    return t.numpy().astype(np.float64)


@pytest.mark.parametrize("dtype", TORCH, ids=str)
def test_torch_collectives(comm, dtype):
    n, r = comm.size, comm.rank
    op = "max" if dtype == torch.bool else "sum"
    rows = 2 * n
    x = torch.from_numpy(values(r, rows)).to(dtype)
    red = [torch.from_numpy(values(q, rows)).to(dtype) for q in range(n)]
    out = comm.allreduce(x, op=op)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == x.shape
    np.testing.assert_array_equal(as_np(out), reference(red, op, dtype == torch.uint8))

    g = comm.allgather(x[: r + 1])
    assert isinstance(g, torch.Tensor) and g.dtype == dtype
    np.testing.assert_array_equal(as_np(g), np.concatenate([as_np(t[: q + 1]) for q, t in enumerate(red)]))

    b = comm.broadcast(x, root=n - 1)
    assert b.dtype == dtype and torch.equal(b, red[n - 1])

    a = comm.alltoall(x)
    assert a.dtype == dtype and a.shape == x.shape
    np.testing.assert_array_equal(as_np(a), np.concatenate([as_np(t)[2 * r:2 * r + 2] for t in red]))

    if dtype != torch.bool:
        rs = comm.reduce_scatter(x, op="sum")
        assert rs.dtype == dtype and rs.shape == (2, 2)
        full = reference(red, "sum", dtype == torch.uint8)
        np.testing.assert_array_equal(as_np(rs), full[2 * r:2 * r + 2])


def test_torch_views_grads_and_async(comm):
    n = comm.size
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x = base.t()  # not contiguous
    out = comm.allreduce(x, op="avg")
    assert out.shape == (4, 3) and torch.equal(out, x)
    w = torch.ones(3, requires_grad=True)
    out = comm.allreduce(w)
    assert not out.requires_grad and torch.equal(out, torch.full((3,), float(n)))
    assert torch.equal(w, torch.ones(3)), "the input must not change"
    h = comm.allreduce_async(torch.ones(5, dtype=torch.float64))
    res = h.wait()
    assert isinstance(res, torch.Tensor) and torch.equal(res, torch.full((5,), float(n), dtype=torch.float64))


def test_torch_send_recv_like(comm):
    n, r = comm.size, comm.rank
    if comm.backend == "horovod":
        pytest.skip("the horovod backend has no point-to-point messages (tested in test_collectives)")
    h = comm.send_async(torch.full((2, 3), r, dtype=torch.bfloat16), dest=(r + 1) % n)
    got = comm.recv((r - 1) % n, like=torch.empty(0))
    h.wait()
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16
    assert torch.equal(got, torch.full((2, 3), (r - 1) % n, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", TF, ids=lambda d: d.name)
def test_tf_collectives(comm, dtype):
    n, r = comm.size, comm.rank
    op = "min" if dtype == tf.bool else "sum"
    x = tf.cast(tf.constant(values(r, 2 * n)), dtype)
    red = [tf.cast(tf.constant(values(q, 2 * n)), dtype) for q in range(n)]
    out = comm.allreduce(x, op=op)
    assert isinstance(out, tf.Tensor) and out.dtype == dtype and out.shape == x.shape
    np.testing.assert_array_equal(as_np(out), reference(red, op, dtype == tf.uint8))
    g = comm.allgather(x[: r + 1])
    assert g.dtype == dtype
    np.testing.assert_array_equal(as_np(g), np.concatenate([as_np(t[: q + 1]) for q, t in enumerate(red)]))
    b = comm.broadcast(x, root=0)
    assert b.dtype == dtype
    np.testing.assert_array_equal(as_np(b), as_np(red[0]))


def test_tf_variable_and_async(comm):
    n = comm.size
    v = tf.Variable(tf.ones((2, 2)))
    out = comm.allreduce(v, op="avg")
    assert isinstance(out, tf.Tensor) and out.dtype == tf.float32
    np.testing.assert_array_equal(out.numpy(), np.ones((2, 2)))
    res = comm.allreduce_async(tf.constant([1.0, 2.0], dtype=tf.bfloat16)).wait()
    assert res.dtype == tf.bfloat16
    np.testing.assert_array_equal(res.numpy().astype(np.float32), np.array([n, 2 * n], dtype=np.float32))
    assert res.numpy().dtype == BFLOAT16
