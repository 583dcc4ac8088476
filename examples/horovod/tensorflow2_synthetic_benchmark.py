"""Synthetic Keras ResNet training throughput in Horovod's style, on hpctrain.horovod (one import changed).

    hpctrain launch -np 2 python examples/horovod/tensorflow2_synthetic_benchmark.py --model ResNet50 \\
        --batch-size 4 --image-size 64

The step is Horovod's TensorFlow 2 recipe: a ``tf.function`` with
``hvd.DistributedGradientTape`` around the tape, variables broadcast from
rank 0 after the first step.  ``--api`` picks what averages the gradients:
``hpctrain.horovod`` (default: Horovod's API on hpctrain), ``hpctrain``
(hpctrain's native TensorFlow API) or ``none`` (every rank trains alone:
the compute-only step).  The model is one of ``keras.applications``, built
with random weights (nothing is downloaded).  Rank 0 prints img/s per rank
and in total, as Horovod's example does, and ``--json`` writes them.
"""
import argparse
import importlib
import json
import os
import timeit

import keras
import numpy as np
import tensorflow as tf

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
p.add_argument("--model", default="ResNet50", help="a model of keras.applications")
p.add_argument("--batch-size", type=int, default=4, help="images per rank per step")
p.add_argument("--image-size", type=int, default=224)
p.add_argument("--num-warmup-batches", type=int, default=3)
p.add_argument("--num-batches-per-iter", type=int, default=3)
p.add_argument("--num-iters", type=int, default=3)
p.add_argument("--api", default="hpctrain.horovod", choices=("hpctrain.horovod", "hpctrain", "none"))
p.add_argument("--json", default="", help="write the figures of rank 0 here")
args = p.parse_args()

if args.api == "hpctrain.horovod":
    hvd = importlib.import_module("hpctrain.horovod.tensorflow")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    def distributed(tape):
        return hvd.DistributedGradientTape(tape, compression=compression)

    def broadcast(variables):
        hvd.broadcast_variables(variables, root_rank=0)
elif args.api == "hpctrain":
    import hpctrain
    import hpctrain.tensorflow as htf
    comm = hpctrain.init()
    rank, size = comm.rank, comm.size

    def distributed(tape):
        return htf.DistributedGradientTape(tape, compression="fp16" if args.fp16_allreduce else None)

    def broadcast(variables):
        htf.broadcast_variables(variables, root=0)
else:
    rank, size = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))

    def distributed(tape):
        return tape

    def broadcast(variables):
        pass

keras.utils.set_random_seed(0)
model = getattr(keras.applications, args.model)(weights=None, input_shape=(args.image_size, args.image_size, 3))
opt = keras.optimizers.SGD(0.01)
data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=999, dtype=tf.int64)


@tf.function
def benchmark_step():
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = keras.losses.sparse_categorical_crossentropy(target, probs)
    gradients = distributed(tape).gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))


def log(text):
    if rank == 0:
        print(text, flush=True)


log(f"Model: {args.model}, batch size {args.batch_size}, image size {args.image_size}, api {args.api}")
log(f"Number of CPUs: {size}")
benchmark_step()
broadcast(model.variables + opt.variables)      # after the first step, which builds the optimizer
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
img_secs = []
for x in range(args.num_iters):
    t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_secs.append(args.batch_size * args.num_batches_per_iter / t)
    log(f"Iter #{x}: {img_secs[-1]:.1f} img/sec per CPU")
mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {size} CPU(s): {size * mean:.1f} +-{size * conf:.1f}")
if args.json and rank == 0:
    with open(args.json, "w") as f:
        json.dump({"api": args.api, "model": args.model, "ranks": size, "batch_size": args.batch_size,
                   "image_size": args.image_size, "img_per_s_per_rank": mean, "img_per_s": size * mean,
                   "iterations": img_secs}, f, indent=1)
