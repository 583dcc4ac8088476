"""A Horovod-style elastic TensorFlow 2 script on ``hpctrain.horovod.tensorflow``, for tests/test_horovod_elastic.py.

Written the way Horovod's TF2 elastic recipe is: a Keras model and optimizer in ``hvd.elastic.TensorFlowKerasState``
with counters, a ``tf.function`` step through ``hvd.DistributedGradientTape``, a reset callback that scales the
learning rate to the new size, a commit after every batch.  ``--exit EPOCH:BATCH:R1,R2`` SIGKILLs the ranks that
started as R1, R2 (``HOROVOD_RANK``) at that epoch and batch.  Rank 0 appends one JSON line per finished epoch to
``--log``, and at the end whether every rank's weights (and the optimizer's iteration count) are identical.
"""
import argparse
import json
import os
import signal

import numpy as np
import tensorflow as tf

import hpctrain.horovod.tensorflow as hvd

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batches", type=int, default=6)
p.add_argument("--exit", default="", help="EPOCH:BATCH:START_RANKS")
p.add_argument("--log", required=True)
args = p.parse_args()

hvd.init()
start_rank = int(os.environ["HOROVOD_RANK"])
exit_at = None
if args.exit:
    epoch, batch, ranks = args.exit.split(":")
    exit_at = (int(epoch), int(batch), {int(r) for r in ranks.split(",")})

rng = np.random.RandomState(0)
x = tf.constant(rng.randn(64, 4).astype(np.float32))
y = tf.constant((rng.randn(64) > 0).astype(np.int64))
tf.keras.utils.set_random_seed(1)
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="tanh"),
                             tf.keras.layers.Dense(2)])
base_lr = 0.01
optimizer = tf.keras.optimizers.SGD(base_lr * hvd.size(), momentum=0.9)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def step(rows):
    with tf.GradientTape() as tape:
        loss = loss_fn(tf.gather(y, rows), model(tf.gather(x, rows), training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


def on_reset():
    optimizer.learning_rate.assign(base_lr * hvd.size())


state = hvd.elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0, entered=0)
state.register_reset_callbacks([on_reset])


@hvd.elastic.run
def train(state):
    state.entered += 1
    while state.epoch < args.epochs:
        while state.batch < args.batches:
            if exit_at and exit_at[:2] == (state.epoch, state.batch) and start_rank in exit_at[2]:
                os.kill(os.getpid(), signal.SIGKILL)
            first = (state.epoch * args.batches + state.batch) * 8 % 64
            step(tf.range(first + hvd.rank(), first + 8, hvd.size()))
            state.batch += 1
            state.commit()
        if hvd.rank() == 0:
            with open(args.log, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "size": hvd.size(), "start_rank": start_rank,
                                    "entered": state.entered,
                                    "lr": float(optimizer.learning_rate.numpy())}) + "\n")
        state.epoch += 1
        state.batch = 0
        state.commit()


train(state)
flat = np.concatenate([v.numpy().reshape(-1) for v in model.variables] + [[float(optimizer.iterations.numpy())]])
every = hvd.allgather_object(flat.tolist())
if hvd.rank() == 0:
    with open(args.log, "a") as f:
        f.write(json.dumps({"identical": all(e == every[0] for e in every), "ranks": len(every),
                            "iterations": int(optimizer.iterations.numpy())}) + "\n")
