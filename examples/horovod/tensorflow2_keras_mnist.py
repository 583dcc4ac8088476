"""A small Keras CNN on handwritten digits in Horovod's style, on hpctrain.horovod (one import changed).

    hpctrain launch -np 2 python examples/horovod/tensorflow2_keras_mnist.py --epochs 6
    python examples/horovod/tensorflow2_keras_mnist.py --num-proc 2      # through hpctrain.horovod.run

Horovod's Keras recipe: ``hvd.DistributedOptimizer`` around Adam with the
learning rate scaled by the ranks, ``BroadcastGlobalVariablesCallback``,
``MetricAverageCallback`` and ``LearningRateWarmupCallback``, each rank
shuffling its own stream, steps per epoch divided by the ranks, checkpoints
from rank 0 only.  The data are scikit-learn's bundled 8x8 digits (1797
images, no download) scaled to 28x28 as MNIST's; 20% are held out.  Rank 0
prints the test accuracy; ``--min-accuracy`` makes the script fail below it.
Works with Keras 3, and with Keras 2 under ``TF_USE_LEGACY_KERAS=1``.
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import tensorflow as tf

import hpctrain.horovod as horovod
import hpctrain.horovod.tensorflow.keras as hvd

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=6)
p.add_argument("--steps", type=int, default=120, help="steps per epoch on one rank (divided by the ranks)")
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--min-accuracy", type=float, default=0.0)
p.add_argument("--checkpoint-dir", default="", help="rank 0 saves the model here every epoch (default: a temp dir)")
p.add_argument("--num-proc", type=int, help="run through hpctrain.horovod.run on this many ranks")


def digits():
    """((train images, labels), (test images, labels)): 28x28x1 floats in [0, 1], a fixed 80/20 split."""
    from sklearn.datasets import load_digits
    d = load_digits()
    rows = np.arange(28) * 8 // 28
    images = (d.images[:, rows][:, :, rows] / 16.0).astype(np.float32)[..., np.newaxis]
    order = np.random.default_rng(0).permutation(len(images))
    cut = int(0.8 * len(images))
    return (images[order[:cut]], d.target[order[:cut]]), (images[order[cut:]], d.target[order[cut:]])


def main(args):
    hvd.init()
    keras = tf.keras
    (x, y), (x_test, y_test) = digits()
    dataset = tf.data.Dataset.from_tensor_slices((x, y.astype(np.int64))).repeat().shuffle(
        2000, seed=hvd.rank()).batch(args.batch_size)
    model = keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    scaled_lr = 0.002 * hvd.size()                            # Horovod: scale the rate with the ranks
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])
    callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                 hvd.callbacks.MetricAverageCallback(),
                 hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1)]
    folder = args.checkpoint_dir or tempfile.mkdtemp(prefix="hvd-keras-mnist-")
    if hvd.rank() == 0:                                       # checkpoints from rank 0 only
        name = "checkpoint-{epoch}.keras" if keras.__name__.startswith("keras") else "checkpoint-{epoch}.h5"
        callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(folder, name)))
    model.fit(dataset, steps_per_epoch=args.steps // hvd.size(), callbacks=callbacks, epochs=args.epochs,
              verbose=2 if hvd.rank() == 0 else 0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    accuracy = float(hvd.allreduce(accuracy))                 # the same number on every rank
    if hvd.rank() == 0:
        print(f"test accuracy {100 * accuracy:.2f}% on {hvd.size()} rank(s)", flush=True)
    return accuracy


if __name__ == "__main__":
    args = p.parse_args()
    if args.num_proc:
        accuracy = horovod.run(main, args=(args,), np=args.num_proc)[0]
    else:
        accuracy = main(args)
    sys.exit(0 if accuracy >= args.min_accuracy else 1)
