"""Keras 3 LocalSGDOptimizer (local SGD, DiLoCo) on every rank of a launch, against one-process Keras references.

Synchronous training is a plain optimizer on all ranks' batches at once; DiLoCo is simulated with one model
copy and one inner AdamW per rank and Keras's own SGD with Nesterov momentum as the outer optimizer, fed the
averaged delta as its gradient.  float32 in another order of operations: 1e-5 relative.
"""
import keras
import numpy as np
import pytest

import hpctrain.tensorflow.keras as hk

B = 4


def make_model(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(9, activation="tanh"), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def data(step, n):
    g = np.random.default_rng(41 + step)
    return g.standard_normal((n * B, 6)).astype("float32"), g.standard_normal((n * B, 3)).astype("float32")


def assert_close(got_weights, want_weights, rtol=1e-5):
    for got, want in zip(got_weights, want_weights):
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= rtol, f"max relative difference {err:.3g}"


def assert_identical_across_ranks(comm, model):
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    assert len(set(comm.allgather_object(flat.tobytes()))) == 1, "replicas differ"


def test_keras_every_step_without_outer_optimizer_equals_synchronous_training(comm):
    n, r = comm.size, comm.rank
    opt = hk.LocalSGDOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), sync_every=1)
    model, ref = make_model(opt), make_model(keras.optimizers.SGD(0.1, momentum=0.9))
    for step in range(5):
        x, y = data(step, n)
        model.train_on_batch(x[r * B:(r + 1) * B], y[r * B:(r + 1) * B])
        ref.train_on_batch(x, y)
        assert_identical_across_ranks(comm, model)
    assert_close(model.get_weights(), ref.get_weights())
    assert opt.local_sgd.syncs == 5


def test_keras_diloco_equals_a_one_process_simulation_of_its_rule(comm):
    """DiLoCo's defaults (inner AdamW lr 4e-4, weight decay 0.1, betas 0.9/0.95; outer SGD Nesterov lr 0.7,
    momentum 0.9), H = 2, 3 outer steps."""
    import tensorflow as tf

    n, r, H = comm.size, comm.rank, 2

    def adamw():
        return keras.optimizers.AdamW(4e-4, weight_decay=0.1, beta_1=0.9, beta_2=0.95)
    opt = hk.LocalSGDOptimizer(adamw(), sync_every=H, outer_lr=0.7, outer_momentum=0.9)
    model = make_model(opt)
    copies = [make_model(adamw()) for _ in range(n)]
    glob = make_model(keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True))
    for step in range(3 * H):
        x, y = data(step, n)
        model.train_on_batch(x[r * B:(r + 1) * B], y[r * B:(r + 1) * B])
        for k, c in enumerate(copies):
            c.train_on_batch(x[k * B:(k + 1) * B], y[k * B:(k + 1) * B])
        if (step + 1) % H == 0:
            deltas = [sum(g - cw for cw in ws) / n
                      for g, *ws in zip(glob.get_weights(), *(c.get_weights() for c in copies))]
            glob.optimizer.apply([tf.constant(d) for d in deltas], glob.trainable_variables)
            for c in copies:
                c.set_weights(glob.get_weights())
            assert_identical_across_ranks(comm, model)
            assert_close(model.get_weights(), glob.get_weights())
    assert opt.local_sgd.syncs == 3


def test_keras_local_sgd_refuses_what_it_cannot_wrap(comm):
    with pytest.raises(TypeError, match="wraps a keras.optimizers.Optimizer"):
        hk.LocalSGDOptimizer(object())
    with pytest.raises(ValueError, match="sync_every >= 1"):
        hk.LocalSGDOptimizer(keras.optimizers.SGD(0.1), sync_every=0)


def test_keras_diloco_resumed_from_a_checkpoint_goes_on_as_if_never_stopped(comm, ckdir):
    """Saved mid-round (step 6 of rounds of 4): each rank's own variables, optimizer variables and the outer
    state come back into a fresh model and optimizer, and the run ends bit for bit where the unbroken one does."""
    from hpctrain.checkpoint import CheckpointManager

    n, r = comm.size, comm.rank

    def diloco():
        return hk.LocalSGDOptimizer(keras.optimizers.AdamW(0.01, weight_decay=0.1), sync_every=4, outer_lr=0.7)

    def run(model, steps):
        for step in steps:
            x, y = data(step, n)
            model.train_on_batch(x[r * B:(r + 1) * B], y[r * B:(r + 1) * B])

    straight = make_model(diloco())
    run(straight, range(10))
    opt = diloco()
    model = make_model(opt)
    run(model, range(6))
    with CheckpointManager(ckdir, comm=comm, verify_replicas="off") as manager:
        manager.save(6, {"model": model, "optimizer": opt})
    opt2 = diloco()
    fresh = make_model(opt2)
    fresh.set_weights([w + 1 for w in fresh.get_weights()])
    opt2.build(fresh.trainable_variables)
    assert CheckpointManager(ckdir, comm=comm).restore({"optimizer": opt2, "model": fresh}) == 6
    assert opt2.local_sgd.steps == 6 and opt2.local_sgd.syncs == 1
    run(fresh, range(6, 10))
    for got, want in zip(fresh.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(got, want)
