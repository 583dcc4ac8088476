"""Elastic data-parallel training with Keras 3 ``fit``: survives killed ranks and goes on, mid-epoch, at the new size.

Run with ``hpctrain launch --elastic -n 3 examples/elastic_keras.py --kill 2:7`` (rank 2 kills itself with
SIGKILL before step 7): the survivors re-form the world, go back to the last commit and go on in the middle of
the epoch with its unseen samples dealt over the new size (:func:`hpctrain.tensorflow.elastic_fit`).  Rank 0
prints the recoveries, and with ``--out F`` saves the final weights (safetensors) and a JSON summary next to them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal

import numpy as np

import hpctrain
import hpctrain.elastic
import hpctrain.tensorflow as htf


def make_data(samples: int):
    """A regression task: ``samples`` inputs of 32 values and their targets (float64, the same on every rank)."""
    rng = np.random.RandomState(1)
    x = rng.standard_normal((samples, 32))
    return x, np.tanh(x @ rng.standard_normal((32, 1)))


def make_model():
    """The model (a two-layer perceptron, float64) and its local optimizer, the same on every rank."""
    import keras

    keras.config.set_floatx("float64")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="tanh"), keras.layers.Dense(1)])
    return model, keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--commit-every", type=int, default=1, help="steps between commits")
    p.add_argument("--kill", action="append", default=[], metavar="RANK:STEP",
                   help="the rank (of the first world) that kills itself before this global step")
    p.add_argument("--log-steps", action="store_true", help="rank 0 prints 'step N' after each step")
    p.add_argument("--out", help="file for the final weights (.safetensors) and its .json summary")
    args = p.parse_args()
    kills = {int(r): int(s) for r, s in (k.split(":") for k in args.kill)}

    import keras

    import hpctrain.tensorflow.keras as hk

    first_rank = hpctrain.init().rank
    x, y = make_data(args.samples)
    model, opt = make_model()
    opt = hk.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss="mse")
    state = htf.KerasState(model, opt, sampler=hpctrain.elastic.ElasticSampler(args.samples, seed=3), epoch=0,
                           step=0)
    resumed_at = []         # the step each re-forming went back to
    state.register_reset_callbacks([lambda: resumed_at.append(state.step)])

    class Steps(keras.callbacks.Callback):
        """Count the steps (committed with the state); the kills of --kill."""

        def on_train_batch_begin(self, batch, logs=None):
            if kills.get(first_rank) == state.step:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, batch, logs=None):
            state.step += 1
            if args.log_steps and hpctrain.world().rank == 0:
                print(f"step {state.step}", flush=True)

    @hpctrain.elastic.run
    def train(state):
        return htf.elastic_fit(model, x, y, state=state, batch_size=args.batch, epochs=args.epochs,
                               batches_per_commit=args.commit_every, callbacks=[Steps()], verbose=0)

    history = train(state)
    w = hpctrain.world()
    if w.rank == 0:
        print(f"finished: {state.step} steps, world of {w.size}, {len(state.recoveries)} re-formings, "
              f"last loss {history['loss'][-1]:.4g}", flush=True)
        if args.out:
            from safetensors.numpy import save_file

            save_file({f"w{i}": np.ascontiguousarray(v) for i, v in enumerate(model.get_weights())}, args.out)
            with open(args.out + ".json", "w") as f:
                json.dump({"steps": state.step, "size": w.size, "resumed_at": resumed_at,
                           "recoveries": state.recoveries}, f, indent=1)


if __name__ == "__main__":
    main()
