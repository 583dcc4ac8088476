"""Train a small Keras CNN on scikit-learn's digits data with model.fit, data-parallel over any number of ranks.

    python examples/tf_digits.py                       # one process
    hpctrain launch -n 4 python examples/tf_digits.py  # four ranks (mpirun, or srun under Slurm)
    ... --checkpoint-dir ckpt                          # checkpoint every epoch; rerun to resume
    ... --compression topk:ratio=0.01                  # compress the gradients (hpctrain.compression)

Keras 3 with the TensorFlow backend.  The data (1797 real 8x8 images) ships
inside scikit-learn; nothing is downloaded.  The global batch is fixed
(``--global-batch``): each of N ranks trains on ``global_batch / N`` samples
per step, so the run converges the same way at any rank count.  Only rank 0
prints (Keras' progress bar and the summary).  The lines marked ``# hpctrain``
are all that data parallelism adds to a plain Keras script.

With ``--checkpoint-dir`` the model, the optimizer and the epoch are
checkpointed at the end of every epoch; running the same command again
resumes after the newest valid checkpoint, at any rank count.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hpctrain  # noqa: E402                                        # hpctrain
import hpctrain.compression  # noqa: E402                            # hpctrain
import hpctrain.tensorflow as htf  # noqa: E402                      # hpctrain
import hpctrain.tensorflow.keras as hk  # noqa: E402                 # hpctrain
from hpctrain.checkpoint import CheckpointManager, Sharded  # noqa: E402  # hpctrain
from hpctrain.data import DistributedSampler  # noqa: E402           # hpctrain


def build_model() -> keras.Model:
    """A small CNN for 8x8x1 inputs."""
    init = "he_uniform"
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu", kernel_initializer=init),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", kernel_initializer=init),
        keras.layers.MaxPooling2D(2), keras.layers.Flatten(), keras.layers.Dropout(0.3),
        keras.layers.Dense(64, activation="relu", kernel_initializer=init), keras.layers.Dense(10)])


def load_data(seed: int):
    """Return (x_train, y_train, x_test, y_test) as numpy arrays, the same split on every rank."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int64)
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=0.2, random_state=seed, stratify=y)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def evaluate(model, x, y, comm) -> float:
    """Return the accuracy on (x, y), each rank scoring its share of the samples."""
    shard = sorted(set(DistributedSampler(len(y), shuffle=False).indices()))
    mine = np.zeros(2)
    if shard:
        pred = np.argmax(model.predict(x[shard], verbose=0), axis=1)
        mine[:] = [(pred == y[shard]).sum(), len(shard)]
    correct, total = comm.allreduce(mine, op="sum")
    return correct / total


class Checkpoint(keras.callbacks.Callback):
    """Save the model, the optimizer and the epoch at the end of every epoch."""

    def __init__(self, manager, state):
        super().__init__()
        self.manager, self.state = manager, state

    def on_epoch_end(self, epoch, logs=None):
        self.manager.save(epoch + 1, self.state)                                  # hpctrain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=36)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compression", help="gradient compressor, e.g. fp16, topk:ratio=0.01, powersgd:rank=2 "
                                          "(see hpctrain.compression)")
    ap.add_argument("--compress-min-numel", type=int, default=1024,
                    help="tensors with fewer values stay uncompressed (biases and norms always do)")
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit with an error below this test accuracy")
    ap.add_argument("--out", help="write a JSON summary here (rank 0)")
    ap.add_argument("--checkpoint-dir", help="checkpoint here every epoch; resume from it")
    ap.add_argument("--metrics-dir", help="per-step metrics here (CSV, JSONL, TensorBoard) and, at the end, "
                    "their plots (hpctrain report)")
    args = ap.parse_args()

    comm = hpctrain.init()                                                        # hpctrain
    n, rank = comm.size, comm.rank
    if args.global_batch % n:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {n} ranks")
    # the launcher's or the user's OMP_NUM_THREADS wins (nodes may share cores: namespace nodes, shared hosts)
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // hpctrain.local_size()))
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    keras.utils.set_random_seed(args.seed + rank)   # replicas start different; the broadcast makes them equal

    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = build_model()
    sampler = DistributedSampler(len(y_train), seed=args.seed)                    # hpctrain
    steps_per_epoch = -(-len(sampler) // (args.global_batch // n))
    lr = keras.optimizers.schedules.CosineDecay(args.lr, decay_steps=args.epochs * steps_per_epoch)
    compressor = hpctrain.compression.from_spec(args.compression) if args.compression else None
    optimizer = hk.DistributedOptimizer(                                      # hpctrain
        keras.optimizers.Adam(lr), compression=compressor,
        compression_policy=hpctrain.compression.Policy(args.compress_min_numel))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    initial_epoch = 0
    callbacks = [hk.MetricAverageCallback(), hk.BroadcastGlobalVariablesCallback(root=0)]   # hpctrain
    manager = None
    if args.checkpoint_dir:
        optimizer.build(model.trainable_variables)   # restore needs the optimizer's variables
        state = {"model": model, "optimizer": optimizer}
        if compressor is not None:
            state["compressor"] = Sharded(compressor)   # residuals differ per rank      # hpctrain
        manager = CheckpointManager(args.checkpoint_dir, keep=2)                  # hpctrain
        initial_epoch = manager.restore(state) or 0                               # hpctrain
        if rank == 0 and initial_epoch:
            print(f"resumed from the checkpoint of epoch {initial_epoch} in {args.checkpoint_dir}", flush=True)
        callbacks.append(Checkpoint(manager, state))
    step_metrics = None
    if args.metrics_dir:   # step time, samples/s, communication share, stragglers, resource use     # hpctrain
        step_metrics = hk.StepMetricsCallback(args.metrics_dir, samples_per_step=args.global_batch // n,
                                              step=initial_epoch * steps_per_epoch)
        callbacks.append(step_metrics)
    sampler.set_epoch(initial_epoch)
    data = htf.distributed_dataset((x_train, y_train), args.global_batch // n, sampler)    # hpctrain

    start = time.perf_counter()
    history = model.fit(data, epochs=args.epochs, initial_epoch=initial_epoch, callbacks=callbacks,
                        shuffle=False,                # (the dataset shuffles each epoch; Keras warns otherwise)
                        verbose=2 if rank == 0 else 0)                            # hpctrain: rank 0 prints
    if manager:
        manager.close()                                                           # hpctrain
    elapsed = time.perf_counter() - start

    accuracy = evaluate(model, x_test, y_test, comm)
    digest = hashlib.sha256(np.concatenate([np.asarray(v.numpy()).reshape(-1) for v in model.variables])
                            .tobytes()).hexdigest()
    identical = len(set(comm.allgather_object(digest))) == 1
    summary = {"ranks": n, "epochs": args.epochs, "global_batch": args.global_batch, "test_accuracy": accuracy,
               "replicas_identical": identical, "train_seconds": elapsed,
               "final_loss": (history.history.get("loss") or [None])[-1],
               "steps": (args.epochs - initial_epoch) * steps_per_epoch,
               "compression": optimizer.compression_stats() if compressor is not None else None}
    if rank == 0:
        print(f"test accuracy {accuracy:.4f} on {len(y_test)} images after {args.epochs} epochs "
              f"on {n} rank(s) in {elapsed:.1f} s; replicas identical: {identical}")
        if step_metrics and step_metrics.metrics:
            from hpctrain.observe.report import write_report
            summary["step_metrics"] = step_metrics.metrics.summary()
            write_report(args.metrics_dir)
            print(f"per-step metrics, plots and summary.md in {args.metrics_dir} "
                  f"(tensorboard --logdir {os.path.join(args.metrics_dir, 'tensorboard')})")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=2)
    if accuracy < args.min_accuracy or not identical:
        raise SystemExit(f"rank {rank}: accuracy {accuracy:.4f} < {args.min_accuracy} or replicas differ")
    hpctrain.shutdown()


if __name__ == "__main__":
    main()
