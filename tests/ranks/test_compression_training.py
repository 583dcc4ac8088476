"""Training with every compressor converges, in PyTorch and in TensorFlow, on scikit-learn's digits.

The task: an MLP (64-64-10) on the 8x8 digits (1400 training images, 397
held out), 4 epochs of batches of 16 per rank, every weight matrix compressed
(biases stay dense by the default name policy).  Uncompressed training
reaches 0.94-0.97 test accuracy here at 1-4 ranks; chance is 0.10.  Each
compressor must reach 0.80: a compressor that drops or garbles what it sends
(a wrong index, a lost residual, a missing scale) lands near chance or
diverges.  Runs are deterministic (seeded data order, seeded compressor
randomness, deterministic reductions), so the figures do not drift.

Also: the compressor's state round-trips through CheckpointManager as a
Sharded entry, and a resumed run continues bit for bit like an uninterrupted
one; the optimizers report the bytes they sent.
"""
import hashlib
import os
import shutil
import tempfile

import numpy as np
import pytest

import hpctrain.compression as C
from hpctrain.data import DistributedSampler

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# name -> (compressor arguments, optimizer momentum, learning rate)
CASES = {
    "none": ({}, 0.9, 0.1), "fp16": ({}, 0.9, 0.1), "bf16": ({}, 0.9, 0.1),
    "topk": ({"ratio": 0.05}, 0.9, 0.1), "randomk": ({"ratio": 0.25}, 0.9, 0.05),
    "threshold": ({"tau": 0.01}, 0.9, 0.1), "dgc": ({"ratio": 0.05, "warmup_steps": 20}, 0.0, 0.1),
    "qsgd": ({"levels": 16}, 0.9, 0.1), "terngrad": ({}, 0.9, 0.05), "signsgd": ({}, 0.0, 0.002),
    "efsignsgd": ({}, 0.0, 0.3), "onebit": ({}, 0.0, 0.3), "powersgd": ({"rank": 2, "start_iter": 10}, 0.9, 0.1),
}
MIN_ACCURACY = 0.80
B, EPOCHS = 16, 4
POLICY = C.Policy(min_numel=0)


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    perm = np.random.default_rng(0).permutation(len(x))
    return x, y.astype(np.int64), perm[:1400], perm[1400:]


def batches(comm, train, epochs=EPOCHS):
    sampler = DistributedSampler(len(train), seed=0, num_replicas=comm.size, rank=comm.rank)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        idx = np.array(list(sampler))
        for s in range(0, len(idx) - B + 1, B):
            yield train[idx[s:s + B]]


def torch_run(comm, name, kwargs, momentum, lr):
    import torch

    from hpctrain.torch import DistributedOptimizer, broadcast_parameters

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    comp = C.get(name, **kwargs)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum),
                               model.named_parameters(), compression=comp, compression_policy=POLICY, comm=comm)
    broadcast_parameters(model.state_dict(), comm=comm)
    return model, opt, comp


def torch_train(model, opt, x, y, idx_batches):
    import torch

    for b in idx_batches:
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[b])), torch.from_numpy(y[b]))
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_training_converges_with_every_compressor(comm, name):
    import torch

    kwargs, momentum, lr = CASES[name]
    x, y, train, test = digits()
    model, opt, _ = torch_run(comm, name, kwargs, momentum, lr)
    torch_train(model, opt, x, y, batches(comm, train))
    with torch.no_grad():
        acc = float((model(torch.from_numpy(x[test])).argmax(1).numpy() == y[test]).mean())
    assert acc >= MIN_ACCURACY, f"{name}: test accuracy {acc:.3f} < {MIN_ACCURACY}"
    stats = opt.compression_stats()
    assert stats["steps"] == len(list(batches(comm, train)))
    if name in ("topk", "signsgd", "powersgd", "qsgd"):
        assert stats["ratio_to_fp32"] < 0.35, stats
    params = np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()])
    assert len(set(comm.allgather_object(hashlib.sha256(params.tobytes()).hexdigest()))) == 1, "replicas differ"


# (one of each family that keeps state: sparse with error feedback, low rank, sparse with momentum, quantized with
# choices seeded by the step, signs with error feedback)
@pytest.mark.parametrize("name", ["topk", "powersgd", "dgc", "qsgd", "onebit"])
def test_compressor_state_checkpoints_and_a_resumed_run_continues_bit_for_bit(comm, name):
    import torch

    from hpctrain.checkpoint import CheckpointManager, Sharded

    kwargs, momentum, lr = CASES[name]
    x, y, train, _ = digits()
    plan = list(batches(comm, train, epochs=1))[:40]
    path = comm.broadcast_object(tempfile.mkdtemp(prefix="hpctrain-ckpt-") if comm.rank == 0 else None)
    try:
        model, opt, comp = torch_run(comm, name, kwargs, momentum, lr)
        torch_train(model, opt, x, y, plan[:20])
        manager = CheckpointManager(path, async_save=False)
        manager.save(20, {"model": model, "opt": opt, "compressor": Sharded(comp)})
        torch_train(model, opt, x, y, plan[20:])
        want = [p.detach().clone() for p in model.parameters()]

        model2, opt2, comp2 = torch_run(comm, name, kwargs, momentum, lr)
        assert manager.restore({"model": model2, "opt": opt2, "compressor": Sharded(comp2)}) == 20
        assert comp2.slots.keys() == comp.slots.keys() and all(s.step == 20 for s in comp2.slots.values())
        torch_train(model2, opt2, x, y, plan[20:])
        for w, p in zip(want, model2.parameters()):
            assert torch.equal(w, p.detach()), f"{name}: the resumed run differs"
    finally:
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.share_counts(counts=(2, 3, 4))    # (each compressor trains across ranks; torch runs them all at 1-4)
@pytest.mark.parametrize("name", sorted(CASES))
def test_tensorflow_training_converges_with_every_compressor(comm, name):
    import keras
    import tensorflow as tf

    import hpctrain.tensorflow as htf

    kwargs, momentum, lr = CASES[name]
    x, y, train, test = digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(lr, momentum=momentum)
    opt.build(model.trainable_variables)
    htf.broadcast_variables(model.variables, comm=comm)
    comp = C.get(name, **kwargs)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with htf.DistributedGradientTape(tf.GradientTape(), compression=comp, compression_policy=POLICY,
                                         comm=comm) as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)
        return loss

    for b in batches(comm, train):
        step(tf.constant(x[b]), tf.constant(y[b]))
    acc = float((np.argmax(model(x[test]).numpy(), 1) == y[test]).mean())
    assert acc >= MIN_ACCURACY, f"{name}: test accuracy {acc:.3f} < {MIN_ACCURACY}"
    stats = C.reducer_for(comp, comm).stats()
    assert stats["steps"] == len(list(batches(comm, train)))
    per_step = 0 if name == "none" else 4 if comp.policy_exempt else 2     # casts: all four; others: the kernels
    assert stats["compressed_tensors"] == per_step * stats["steps"], stats


def test_keras_fit_with_a_compressing_distributed_optimizer(comm):
    import keras

    import hpctrain.tensorflow.keras as hk

    x, y, train, test = digits()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    opt = hk.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=C.get("topk", ratio=0.05),
                                  comm=comm)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    mine = train[comm.rank::comm.size][:1400 // comm.size]
    model.fit(x[mine], y[mine], batch_size=B, epochs=EPOCHS, verbose=0,
              callbacks=[hk.BroadcastGlobalVariablesCallback(0, comm=comm)])
    acc = float((np.argmax(model(x[test]).numpy(), 1) == y[test]).mean())
    assert acc >= MIN_ACCURACY, f"test accuracy {acc:.3f}"
    stats = opt.compression_stats()
    assert stats["compressed_tensors"] >= stats["steps"] > 0 and stats["ratio_to_fp32"] < 0.5, stats


def test_bad_compression_arguments_are_refused(comm):
    import torch

    from hpctrain.torch import DistributedOptimizer

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="unknown compressor 'gzip'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="gzip", comm=comm)
    with pytest.raises(TypeError, match="compression must be None, a compressor name"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=3, comm=comm)
    with pytest.raises(ValueError, match="op must be 'avg' or 'sum'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression="fp16", op="max", comm=comm)
