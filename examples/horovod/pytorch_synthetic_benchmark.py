"""Synthetic ResNet training throughput in Horovod's style, on hpctrain.horovod (one import changed).

    hpctrain launch -np 2 python examples/horovod/pytorch_synthetic_benchmark.py --model resnet18 \\
        --batch-size 4 --image-size 64

``--api`` picks what averages the gradients, for side-by-side comparisons
(benchmarks/horovod_compat.py): ``hpctrain.horovod`` (default: Horovod's API
on hpctrain), ``horovod`` (the real Horovod, when installed), ``hpctrain``
(hpctrain's native torch API) or ``none`` (every rank trains alone: the
compute-only step).  Rank 0 prints img/s per rank and in total, as Horovod's
example does, and ``--json`` writes them.
"""
import argparse
import importlib
import json
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import resnets  # noqa: E402  (the ResNets in torch.nn beside this file)

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
p.add_argument("--model", default="resnet18", choices=resnets.__all__)
p.add_argument("--batch-size", type=int, default=4, help="images per rank per step")
p.add_argument("--image-size", type=int, default=224)
p.add_argument("--num-warmup-batches", type=int, default=3)
p.add_argument("--num-batches-per-iter", type=int, default=3)
p.add_argument("--num-iters", type=int, default=3)
p.add_argument("--use-adasum", action="store_true", help="combine gradients with Adasum (hvd.Adasum)")
p.add_argument("--api", default="hpctrain.horovod", choices=("hpctrain.horovod", "horovod", "hpctrain", "none"))
p.add_argument("--json", default="", help="write the figures of rank 0 here")
args = p.parse_args()

torch.manual_seed(0)
model = getattr(resnets, args.model)()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

if args.api in ("hpctrain.horovod", "horovod"):
    hvd = importlib.import_module(args.api + ".torch")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
elif args.api == "hpctrain":
    import hpctrain
    import hpctrain.torch as ht
    comm = hpctrain.init()
    rank, size = comm.rank, comm.size
    optimizer = ht.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        compression="fp16" if args.fp16_allreduce else None)
    ht.broadcast_parameters(model.state_dict(), root=0)
else:
    rank, size = int(os.environ.get("OMPI_COMM_WORLD_RANK", 0)), int(os.environ.get("OMPI_COMM_WORLD_SIZE", 1))

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, 1000, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(text):
    if rank == 0:
        print(text, flush=True)


log(f"Model: {args.model}, batch size {args.batch_size}, image size {args.image_size}, api {args.api}")
log(f"Number of CPUs: {size}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
rates = []
for i in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    rates.append(args.batch_size * args.num_batches_per_iter / seconds)
    log(f"Iter #{i}: {rates[-1]:.1f} img/sec per CPU")
mean, conf = float(np.mean(rates)), float(1.96 * np.std(rates))
log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
log(f"Total img/sec on {size} CPU(s): {size * mean:.1f} +-{size * conf:.1f}")
if args.json and rank == 0:
    with open(args.json, "w") as f:
        json.dump({"api": args.api, "model": args.model, "batch_size": args.batch_size,
                   "image_size": args.image_size, "ranks": size, "img_per_s_per_rank": rates,
                   "total_img_per_s": size * mean}, f)
