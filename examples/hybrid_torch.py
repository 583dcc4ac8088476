"""Hybrid parallelism on scikit-learn's digits: data x pipeline or data x tensor parallel MLPs.

    hpctrain launch -n 4 python examples/hybrid_torch.py --dp 2 --pp 2   # 2 replicas of a 2-stage pipeline
    hpctrain launch -n 4 python examples/hybrid_torch.py --dp 2 --tp 2   # 2 replicas, MLP split over 2 ranks
    python examples/hybrid_torch.py                                       # one process, the same model

The layout (``hpctrain.parallel.ParallelLayout``) gives each rank its
coordinates and the communicator of each axis: the data-parallel optimizer
averages over ``layout.dp_comm``, the pipeline sends activations over
``layout.pp_comm``, the tensor-parallel layers reduce over ``layout.tp_comm``.
Each data-parallel replica reads its share of the data
(``DistributedSampler(num_replicas=dp, rank=dp coordinate)``).  Only rank 0
prints.  The lines marked ``# hpctrain`` are what the parallelism adds.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hpctrain                                          # hpctrain
import hpctrain.torch as ht                              # hpctrain
from hpctrain.data import DistributedSampler             # hpctrain
from hpctrain.parallel import ParallelLayout             # hpctrain


def build(layout, hidden: int, pp: int, tp: int) -> torch.nn.Module:
    """An MLP 64 -> hidden -> 4 hidden -> hidden -> 10 (the same start on every rank, seed 0)."""
    torch.manual_seed(0)
    first, up, down, last = (torch.nn.Linear(64, hidden), torch.nn.Linear(hidden, 4 * hidden),
                             torch.nn.Linear(4 * hidden, hidden), torch.nn.Linear(hidden, 10))
    if tp > 1:                                                                    # hpctrain
        mlp = ht.ParallelMLP.from_linears(up, down, layout.tp_comm)               # hpctrain
        return torch.nn.Sequential(first, torch.nn.ReLU(), mlp, torch.nn.ReLU(), last)
    model = torch.nn.Sequential(torch.nn.Sequential(first, torch.nn.ReLU()),
                                torch.nn.Sequential(up, torch.nn.GELU(), down, torch.nn.ReLU()), last)
    if pp > 1:                                                                    # hpctrain
        return ht.Pipeline(model, layout, micro_batches=4, schedule="1f1b")       # hpctrain
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=None, help="data-parallel replicas (default: what is left)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline stages")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32, help="batch per data-parallel replica")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--min-accuracy", type=float, default=0.0)
    ap.add_argument("--out", help="write a JSON summary here (rank 0)")
    args = ap.parse_args()
    comm = hpctrain.init()                                                        # hpctrain
    if args.pp > 1 and args.tp > 1:
        raise SystemExit("this example combines dp with pp or with tp, not all three")
    dp = args.dp or comm.size // (args.pp * args.tp)
    layout = ParallelLayout(dp=dp, pp=args.pp, tp=args.tp, comm=comm)             # hpctrain
    if "OMP_NUM_THREADS" not in os.environ:      # (the launcher's or the user's choice wins: nodes may share cores)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hpctrain.local_size()))

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    train, test = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0, stratify=digits.target)
    model = build(layout, args.hidden, args.pp, args.tp)
    optimizer = ht.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3),   # hpctrain
                                        comm=layout.dp_comm)                              # hpctrain
    sampler = DistributedSampler(len(train), seed=0, num_replicas=dp, rank=layout.coords["dp"])  # hpctrain
    pipeline = isinstance(model, ht.Pipeline)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = train[np.array(sampler.indices())]
        losses = []
        for i in range(0, len(order) - args.batch + 1, args.batch):
            b = order[i:i + args.batch]
            optimizer.zero_grad()
            if pipeline:
                loss = model.train_step(x[b], y[b], optimizer=optimizer)             # hpctrain
            else:
                loss = F.cross_entropy(model(x[b]), y[b])
                loss.backward()
            optimizer.step()
            losses.append(float(loss))
        mean = ht.average_metrics({"loss": float(np.mean(losses))}, comm=layout.dp_comm)["loss"]   # hpctrain
        if comm.rank == 0 and (epoch + 1) % 5 == 0:
            print(f"epoch {epoch + 1}: loss {mean:.4f}", flush=True)
    with torch.no_grad():
        logits = model.infer(x[test]) if pipeline else model(x[test])
    accuracy = float((logits.argmax(1) == y[test]).float().mean())
    summary = {"ranks": comm.size, "dp": dp, "pp": args.pp, "tp": args.tp, "test_accuracy": accuracy}
    if comm.rank == 0:
        print(f"test accuracy {accuracy:.4f} with dp={dp} pp={args.pp} tp={args.tp} on {comm.size} rank(s)")
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=2)
    if accuracy < args.min_accuracy:
        raise SystemExit(f"rank {comm.rank}: accuracy {accuracy:.4f} < {args.min_accuracy}")
    hpctrain.shutdown()


if __name__ == "__main__":
    main()
