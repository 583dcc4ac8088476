"""Keras 3 ShardedOptimizer (ZeRO) on every rank of a launch, against plain Keras optimizers in one process.

The reference trains a copy of the model with the plain optimizer on all ranks' batches at once (a mean loss:
the average of the ranks' gradients equals the whole batch's), so it shares no code with hpctrain.  113
parameters (a prime: no world size divides it) in tiny buckets, so chunks cut across variables.  float32 sums
in another order: 1e-5 relative, as the unsharded Keras tests.
"""
import keras
import numpy as np
import pytest

import hpctrain.tensorflow.keras as hk

B, STEPS = 4, 6
OPTIMIZERS = {"sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(0.01),
              "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1)}


def make_model(optimizer):
    """6 -> 11 -> 3: 66 + 11 + 33 + 3 = 113 values, compiled with ``optimizer`` and a mean squared error."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(11, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def data(step, n):
    g = np.random.default_rng(77 + step)
    return g.standard_normal((n * B, 6)).astype("float32"), g.standard_normal((n * B, 3)).astype("float32")


def assert_close(model, ref, rtol=1e-5):
    for got, want in zip(model.get_weights(), ref.get_weights()):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= rtol, f"max relative difference {err:.3g}"


def train(model, ref, n, rank, steps):
    for step in steps:
        x, y = data(step, n)
        model.train_on_batch(x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B])
        ref.train_on_batch(x, y)


@pytest.mark.share_counts
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sharded_keras_training_equals_the_plain_optimizer_on_the_whole_batch(comm, name):
    n, r = comm.size, comm.rank
    opt = hk.ShardedOptimizer(OPTIMIZERS[name](), bucket_mb=0.0001)
    model, ref = make_model(opt), make_model(OPTIMIZERS[name]())
    train(model, ref, n, r, range(STEPS))
    assert_close(model, ref)
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    assert len(set(comm.allgather_object(flat.tobytes()))) == 1, "replicas differ"
    zero = opt._hpctrain_zero
    assert len(zero.buckets) > 2
    slots = {"sgd_momentum": 1, "adam": 2, "adamw": 2}[name]
    # this rank's moments: 1/n of the plain optimizer's 113 per slot, up to a bucket's rounding
    assert opt.shard_bytes() <= slots * 4 * (113 / n + len(zero.buckets))
    owned = comm.allgather_object(opt.shard_bytes())
    assert sum(owned) == slots * 4 * 113


def test_keras_gradient_accumulation_equals_the_plain_optimizers(comm):
    """gradient_accumulation_steps=2: two micro-batches a step; the plain optimizer accumulates the same
    micro-batches of every rank at once."""
    n, r = comm.size, comm.rank
    opt = hk.ShardedOptimizer(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), bucket_mb=0.0001)
    model, ref = make_model(opt), make_model(keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))
    for step in range(4):
        x, y = data(step, n)
        for half in (slice(0, B // 2), slice(B // 2, B)):
            rows = np.concatenate([np.arange(k * B, (k + 1) * B)[half] for k in range(n)])
            mine = np.arange(r * B, (r + 1) * B)[half]
            model.train_on_batch(x[mine], y[mine])
            ref.train_on_batch(x[rows], y[rows])
    assert int(opt.iterations.numpy()) == 4
    assert_close(model, ref)


def test_a_keras_state_gathered_at_one_size_loads_at_a_smaller_one(comm):
    n, r = comm.size, comm.rank
    opt = hk.ShardedOptimizer(keras.optimizers.Adam(0.01), bucket_mb=0.0001)
    model, ref = make_model(opt), make_model(keras.optimizers.Adam(0.01))
    train(model, ref, n, r, range(3))
    opt.consolidate_state_dict(to=None)
    whole = opt.state_dict()
    assert int(whole["iterations"]) == 3 and sorted(whole["slots"]) == ["momentum", "velocity"]
    for got, var in zip(whole["slots"]["momentum"], ref.optimizer._momentums):
        np.testing.assert_allclose(got, var.numpy(), rtol=1e-4, atol=1e-7)
    m = max(1, n - 1)
    sub = comm.split(0 if r < m else None)
    if sub is None:
        return
    opt2 = hk.ShardedOptimizer(keras.optimizers.Adam(0.01), comm=sub, bucket_mb=0.0001)
    smaller = make_model(opt2)
    smaller.set_weights(model.get_weights())
    opt2.build(smaller.trainable_variables)
    opt2.load_state_dict(whole)
    train(smaller, ref, m, r, range(3, 6))
    assert_close(smaller, ref)


def test_a_keras_checkpoint_holds_each_ranks_chunks_and_restores_at_a_smaller_size(comm, ckdir):
    from hpctrain.checkpoint import CheckpointError, CheckpointManager

    n, r = comm.size, comm.rank
    opt = hk.ShardedOptimizer(keras.optimizers.Adam(0.01), bucket_mb=0.0001)
    model, ref = make_model(opt), make_model(keras.optimizers.Adam(0.01))
    train(model, ref, n, r, range(3))
    with CheckpointManager(ckdir, comm=comm) as manager:
        manager.save(3, {"model": model, "optimizer": opt})
    m = max(1, n - 1)
    sub = comm.split(0 if r < m else None)
    if sub is not None:
        opt2 = hk.ShardedOptimizer(keras.optimizers.Adam(0.01), comm=sub, bucket_mb=0.0002)
        fresh = make_model(opt2)
        opt2.build(fresh.trainable_variables)
        assert CheckpointManager(ckdir, comm=sub).restore({"model": fresh, "optimizer": opt2}) == 3
        assert int(opt2.iterations.numpy()) == 3
        train(fresh, ref, m, r, range(3, 6))
        assert_close(fresh, ref)
        plain = keras.optimizers.Adam(0.01)        # (a plain Keras optimizer cannot take the chunks: refused)
        other = make_model(plain)
        plain.build(other.trainable_variables)
        with pytest.raises(CheckpointError, match=r"'optimizer' is a ShardedOptimizer's state \(ZeRO\), spread over"):
            CheckpointManager(ckdir, comm=sub).restore({"model": other, "optimizer": plain})


def test_what_keras_cannot_shard_is_refused(comm):
    with pytest.raises(ValueError, match="element by element.*Lamb"):
        hk.ShardedOptimizer(keras.optimizers.Lamb())
    with pytest.raises(ValueError, match="compression.*all-reduce only"):
        hk.ShardedOptimizer(keras.optimizers.Adam(), compression="fp16")
    with pytest.raises(ValueError, match="use_ema"):
        hk.ShardedOptimizer(keras.optimizers.Adam(use_ema=True))
    built = keras.optimizers.Adam()
    built.build([keras.Variable(np.zeros(3, "float32"))])
    with pytest.raises(ValueError, match="before it is built"):
        hk.ShardedOptimizer(built)
    opt = hk.ShardedOptimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match="already distributed"):
        hk.ShardedOptimizer(opt)
    with pytest.raises(RuntimeError, match="not built yet"):
        opt.state_dict()
