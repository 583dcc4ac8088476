"""The README's Keras quickstart (a checkpoint at every epoch end), with a kill: ``keras_epochs.py CKPT [KILL_EPOCH]``.

With KILL_EPOCH (0-based), the last rank SIGKILLs itself early in that epoch, once it sees the checkpoint of the
epoch before committed in CKPT (it waits up to 20 s for it, calling nothing of hpctrain's): the save at an
epoch's end must be committed without a later save() or wait().  Rank 0 prints the epochs it trains.
"""
import os
import signal
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import numpy as np  # noqa: E402

import hpctrain  # noqa: E402
import hpctrain.tensorflow as htf  # noqa: E402
import hpctrain.tensorflow.keras as hk  # noqa: E402
from hpctrain.checkpoint import CheckpointManager  # noqa: E402

ckpt, kill_epoch = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else -1
comm = hpctrain.init()
x = np.random.default_rng(0).standard_normal((2048, 20)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)])
opt = hk.DistributedOptimizer(keras.optimizers.Adam(1e-3 * comm.size))
model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
opt.build(model.trainable_variables)
manager = CheckpointManager(ckpt)
state = {"model": model, "optimizer": opt, "epoch": 0}
manager.restore(state)


class Kill(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if comm.rank == 0:
            print(f"training epoch {epoch}", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        if state["epoch"] == kill_epoch and batch == 2 and comm.rank == comm.size - 1:
            deadline = time.monotonic() + 20
            while manager.latest_step() != kill_epoch and time.monotonic() < deadline:
                time.sleep(0.01)
            print(f"killed in epoch {kill_epoch}; committed: step {manager.latest_step()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def saved(epoch, logs):
    state.update(epoch=epoch + 1)
    manager.save(epoch + 1, state)


model.fit(htf.distributed_dataset((x, y), batch_size=32, seed=0), initial_epoch=state["epoch"], epochs=4,
          verbose=0, shuffle=False, callbacks=[hk.MetricAverageCallback(), hk.BroadcastGlobalVariablesCallback(0), Kill(),
                                keras.callbacks.LambdaCallback(on_epoch_end=saved)])
manager.close()
