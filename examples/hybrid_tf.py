"""Hybrid parallelism with Keras on scikit-learn's digits: data x pipeline parallel MLP stages.

    hpctrain launch -n 4 python examples/hybrid_tf.py --dp 2 --pp 2   # 2 replicas of a 2-stage pipeline
    hpctrain launch -n 2 python examples/hybrid_tf.py --pp 2          # one 2-stage pipeline
    python examples/hybrid_tf.py                                      # one process, the same model

The layout (``hpctrain.parallel.ParallelLayout``) gives each rank its
coordinates and the communicator of each axis.  ``hpctrain.tensorflow.Pipeline``
runs this rank's stage (GPipe or 1F1B over ``--micro-batches``) and returns the
batch loss and this stage's gradients; ``reduce_gradients`` averages them over
``layout.dp_comm`` and the Keras optimizer applies them.  Each data-parallel
replica reads its share of the data (``DistributedSampler(num_replicas=dp, rank=dp
coordinate)``).  Only rank 0 prints.  The lines marked ``# hpctrain`` are what
the parallelism adds.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hpctrain  # noqa: E402                                          # hpctrain
import hpctrain.tensorflow as htf  # noqa: E402                        # hpctrain
from hpctrain.data import DistributedSampler  # noqa: E402             # hpctrain
from hpctrain.parallel import ParallelLayout  # noqa: E402             # hpctrain


def build_stages(hidden: int, pp: int):
    """The MLP 64 -> hidden -> hidden -> 10 as ``pp`` Keras stages (the same start on every rank, seed 0)."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(hidden, activation="relu"),
              keras.layers.Dense(10)]
    if pp > len(layers):
        raise SystemExit(f"--pp {pp}: this model has {len(layers)} layers")
    stages, width = [], 64
    for idx in np.array_split(np.arange(len(layers)), pp):
        stages.append(keras.Sequential([keras.Input((width,))] + [layers[k] for k in idx]))
        width = layers[idx[-1]].units
    return stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: what is left)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages (at most 3)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=32, help="batch per data-parallel replica")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--min-accuracy", type=float, default=0.0)
    ap.add_argument("--out", help="write a JSON summary here (rank 0)")
    args = ap.parse_args()
    comm = hpctrain.init()                                                            # hpctrain
    dp = args.dp or comm.size // args.pp
    layout = ParallelLayout(dp=dp, pp=args.pp, comm=comm)                             # hpctrain
    pipe = htf.Pipeline(build_stages(args.hidden, args.pp), layout,                   # hpctrain
                        micro_batches=args.micro_batches, schedule=args.schedule)     # hpctrain
    optimizer = keras.optimizers.Adam(3e-3)

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    train, test = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0, stratify=y)
    sampler = DistributedSampler(len(train), seed=0, num_replicas=dp, rank=layout.coords["dp"])   # hpctrain
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = train[np.array(sampler.indices())]
        losses = []
        for i in range(0, len(order) - args.batch + 1, args.batch):
            b = order[i:i + args.batch]
            loss, grads = pipe.train_step(x[b], y[b])                                 # hpctrain
            grads = htf.reduce_gradients(grads, comm=layout.dp_comm)                  # hpctrain
            optimizer.apply(grads, pipe.trainable_variables)
            losses.append(loss)
        mean = htf.average_metrics({"loss": float(np.mean(losses))}, comm=layout.dp_comm)["loss"]   # hpctrain
        if comm.rank == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1}: loss {mean:.4f}", flush=True)
    logits = pipe.infer(x[test])                                                      # hpctrain
    accuracy = float((logits.argmax(1) == y[test]).mean())
    summary = {"ranks": comm.size, "dp": dp, "pp": args.pp, "test_accuracy": accuracy}
    if comm.rank == 0:
        print(f"test accuracy {accuracy:.4f} with dp={dp} pp={args.pp} on {comm.size} rank(s)")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=2)
    if accuracy < args.min_accuracy:
        raise SystemExit(f"rank {comm.rank}: accuracy {accuracy:.4f} < {args.min_accuracy}")
    hpctrain.shutdown()


if __name__ == "__main__":
    main()
