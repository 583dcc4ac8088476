"""The TensorFlow/Keras side of benchmarks/scaling.py: models and workers (one launch, one peer).

Peers:

* ``keras``       plain ``model.fit`` in one process (1 rank only: the baseline);
* ``independent`` every rank runs plain ``model.fit`` alone, no communication;
* ``hpctrain``    ``hpctrain.tensorflow.keras.DistributedOptimizer`` (MPI backend);
* ``mwms``        ``tf.distribute.MultiWorkerMirroredStrategy``, TensorFlow's own
  data parallelism (one worker per rank, gRPC collectives on CPU).

Each launch is one ``model.fit`` call over an endless dataset of one fixed
batch; a callback times windows of ``steps`` batches from batch end to batch
end (after 3 warm-up batches), with a barrier at each window boundary as the
torch side has.  Timing inside one ``fit`` call matters: every ``fit`` call
also spends a fixed ~0.3 s starting and ending its epoch here, which would
otherwise count as training time.  One thread per rank for TensorFlow's op pools.
"""
from __future__ import annotations

import json
import os
import time

from common import free_port, paired_windows

PEERS = ("keras", "independent", "hpctrain", "mwms")
MODELS = {"cnn": 32, "mlp": 128}    # model -> per-rank batch


def build(model: str):
    """Return (Keras model, input shape, number of classes): a compute-bound CNN (64x64 RGB) or an MLP."""
    import keras

    if model == "mlp":
        layers = [keras.Input((1024,)), keras.layers.Dense(2048, activation="relu"),
                  keras.layers.Dense(2048, activation="relu"), keras.layers.Dense(10)]
        return keras.Sequential(layers), (1024,), 10
    layers = [keras.Input((64, 64, 3))]
    for filters in (32, 64, 128, 256):
        layers += [keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
                   keras.layers.Conv2D(filters, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(2)]
    layers += [keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(100)]
    return keras.Sequential(layers), (64, 64, 3), 100


def _window_timer(keras, warmup: int, steps: int, barrier=None):
    """A callback recording the seconds of each run of ``steps`` batches after ``warmup`` batches, in ``.times``."""

    class WindowTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.t0 = [], None

        def on_train_batch_end(self, batch, logs=None):
            done = batch + 1 - warmup
            if done < 0 or done % steps:
                return
            if barrier is not None:
                barrier()
            now = time.perf_counter()
            if done > 0:
                self.times.append(now - self.t0)
            self.t0 = now

    return WindowTimer()


def _threads(tf) -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def _dataset(tf, np, rank, batch, shape, classes):
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, classes, batch).astype(np.int64)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def worker(peer: str, model_name: str, batch: int, steps: int, windows: int) -> None:
    """Train ``model_name`` as ``peer`` on this launch's ranks; rank 0 prints RESULT {throughput: [...]}.

    An exception is summed up on one line of stdout (``Error of <peer>: ...``) for the report, then raised.
    """
    try:
        _worker(peer, model_name, batch, steps, windows)
    except Exception as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        brief = lines[0][:160] + (f" ... {lines[-1][:160]}" if len(lines) > 1 else "") if lines else ""
        print(f"Error of {peer}: {type(exc).__name__}: {brief}", flush=True)
        raise


def _worker(peer: str, model_name: str, batch: int, steps: int, windows: int) -> None:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if peer == "mwms":     # must be set before TensorFlow starts
        ports = world.bcast([free_port() for _ in range(size)] if rank == 0 else None, root=0)
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                                              "task": {"type": "worker", "index": rank}})
    import keras
    import numpy as np
    import tensorflow as tf

    _threads(tf)
    if peer == "keras" and size != 1:
        raise SystemExit("the plain Keras loop runs on one rank only")
    keras.utils.set_random_seed(0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    callbacks = []
    if peer == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model, shape, classes = build(model_name)
            model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss=loss)
        # the strategy splits a global batch: give it size x batch so each worker computes batch samples
        data = _dataset(tf, np, 0, batch * size, shape, classes)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
        data = data.with_options(options)
    else:
        model, shape, classes = build(model_name)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        if peer == "hpctrain":
            import hpctrain
            import hpctrain.tensorflow.keras as hk

            hpctrain.init("mpi")
            optimizer = hk.DistributedOptimizer(optimizer)
            callbacks = [hk.BroadcastGlobalVariablesCallback(0)]
        model.compile(optimizer=optimizer, loss=loss)
        data = _dataset(tf, np, rank, batch, shape, classes)
    timer = _window_timer(keras, 3, steps, world.Barrier)      # 3 warm-up batches: tracing, first steps
    model.fit(data, steps_per_epoch=3 + windows * steps, epochs=1, verbose=0, callbacks=callbacks + [timer])
    if rank == 0:
        print("RESULT " + json.dumps({"throughput": [size * batch * steps / t for t in timer.times]}), flush=True)


def overhead_worker(model_name: str, batch: int, steps: int, windows: int) -> None:
    """One rank: alternate timed windows of plain ``model.fit`` and of hpctrain's; print both."""
    import keras
    import numpy as np
    import tensorflow as tf

    import hpctrain
    import hpctrain.tensorflow.keras as hk

    _threads(tf)
    hpctrain.init("mpi")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    runs = {}
    for peer in ("keras", "hpctrain"):
        keras.utils.set_random_seed(0)
        model, shape, classes = build(model_name)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=hk.DistributedOptimizer(optimizer) if peer == "hpctrain" else optimizer, loss=loss)
        runs[peer] = (model, _dataset(tf, np, 0, batch, shape, classes))

    def window(peer: str, n: int) -> float:
        model, data = runs[peer]
        timer = _window_timer(keras, 1, n)
        model.fit(data, steps_per_epoch=1 + n, epochs=1, verbose=0, callbacks=[timer])
        return batch * n / timer.times[0]

    print("RESULT " + json.dumps(paired_windows(window, ["keras", "hpctrain"], windows, steps)), flush=True)
