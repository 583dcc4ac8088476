"""Train a small CNN on scikit-learn's digits data, data-parallel over any number of ranks.

    python examples/torch_digits.py                       # one process
    hpctrain launch -n 4 python examples/torch_digits.py  # four ranks (mpirun, or srun under Slurm)
    mpirun -n 4 python examples/torch_digits.py           # the same, by hand
    ... --checkpoint-dir ckpt                             # checkpoint every epoch; rerun to resume
    ... --compression topk:ratio=0.01                     # compress the gradients (hpctrain.compression)
    ... --metrics-dir results/metrics                     # per-step metrics, TensorBoard, plots

The data (1797 real 8x8 images of hand-written digits) ships inside
scikit-learn; nothing is downloaded.  The global batch is fixed
(``--global-batch``), so each of N ranks trains on ``global_batch / N`` samples
per step and the run converges the same way at any rank count.  Only rank 0
prints (a tqdm bar and the summary).  The lines marked ``# hpctrain`` are all
that data parallelism adds to a plain PyTorch script.

With ``--checkpoint-dir`` the whole training state (model, optimizer, LR
schedule, sampler position, RNG states) is checkpointed every epoch and on
SIGUSR2/SIGTERM (then the job exits with status 75); running the same command
again resumes from the newest valid checkpoint, at any rank count.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import hpctrain                                  # hpctrain
import hpctrain.compression                      # hpctrain
import hpctrain.torch as ht                      # hpctrain
from hpctrain.checkpoint import CheckpointManager, RNGState, Sharded, on_preemption  # hpctrain
from hpctrain.data import DistributedSampler     # hpctrain


def build_model() -> torch.nn.Module:
    """A small CNN for 1x8x8 inputs."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def load_data(seed: int):
    """Return (x_train, y_train, x_test, y_test) as tensors, the same split on every rank."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(np.arange(len(y)), test_size=0.2, random_state=seed, stratify=y)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


def evaluate(model, x, y, comm) -> float:
    """Return the accuracy on (x, y), each rank scoring its share of the samples."""
    shard = DistributedSampler(len(y), shuffle=False, drop_last=False).indices()
    shard = sorted(set(shard))  # padding repeats a few samples; count each once per rank
    mine = np.zeros(2)
    model.eval()
    with torch.no_grad():
        if shard:
            pred = model(x[shard]).argmax(1)
            mine[:] = [(pred == y[shard]).sum().item(), len(shard)]
    model.train()
    # a sample may be counted by two ranks only through padding, which needs more ranks than samples
    correct, total = comm.allreduce(mine, op="sum")
    return correct / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compression", help="gradient compressor, e.g. fp16, topk:ratio=0.01, powersgd:rank=2 "
                                          "(see hpctrain.compression)")
    ap.add_argument("--compress-min-numel", type=int, default=1024,
                    help="tensors with fewer values stay uncompressed (biases and norms always do)")
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit with an error below this test accuracy")
    ap.add_argument("--out", help="write a JSON summary here (rank 0)")
    ap.add_argument("--checkpoint-dir", help="checkpoint here every epoch (and on SIGUSR2/SIGTERM); resume from it")
    ap.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: one epoch)")
    ap.add_argument("--metrics-dir", help="per-step metrics here (CSV, JSONL, TensorBoard) and, at the end, "
                    "their plots (hpctrain report)")
    args = ap.parse_args()

    comm = hpctrain.init()                                                     # hpctrain
    n, rank = comm.size, comm.rank
    if args.global_batch % n:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by {n} ranks")
    if "OMP_NUM_THREADS" not in os.environ:      # (the launcher's or the user's choice wins: nodes may share cores)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hpctrain.local_size()))
    torch.manual_seed(args.seed + rank)   # replicas start different; the broadcast below makes them equal

    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    compressor = hpctrain.compression.from_spec(args.compression) if args.compression else None
    optimizer = ht.DistributedOptimizer(                                                      # hpctrain
        optimizer, named_parameters=model.named_parameters(), compression=compressor,
        compression_policy=hpctrain.compression.Policy(args.compress_min_numel))
    ht.broadcast_parameters(model.state_dict(), root=0)                                       # hpctrain
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    sampler = DistributedSampler(len(y_train), seed=args.seed)                                # hpctrain
    per_rank = args.global_batch // n

    steps_per_epoch = -(-len(sampler) // per_rank)
    total_steps = args.epochs * steps_per_epoch
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
             "rng": Sharded(RNGState(), missing="skip")}
    if compressor is not None:
        state["compressor"] = Sharded(compressor)   # residuals differ per rank                   # hpctrain
    manager, step = None, 0
    if args.checkpoint_dir:
        manager = CheckpointManager(args.checkpoint_dir, keep=2,                              # hpctrain
                                    every_steps=args.checkpoint_every or steps_per_epoch)
        on_preemption(manager)                                                                # hpctrain
        step = manager.restore(state) or 0                                                    # hpctrain
        if rank == 0 and step:
            print(f"resumed from the checkpoint of step {step} in {args.checkpoint_dir}", flush=True)

    metrics = None
    if args.metrics_dir:   # step time, samples/s, communication share, stragglers, resource use       # hpctrain
        metrics = ht.track_steps(optimizer, log_dir=args.metrics_dir, samples_per_step=per_rank, step=step)
    start = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, disable=rank != 0, desc=f"{n} rank(s)", unit="step")
    losses, postfix = [], {}
    while step < total_steps:
        order = sampler.indices()          # what is left of this epoch (all of it unless resumed mid-epoch)
        for i in range(0, len(order), per_rank):
            batch = order[i:i + per_rank]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[batch]), y_train[batch])
            loss.backward()
            optimizer.step()
            sampler.advance(len(batch))
            losses.append(loss.item())
            step += 1
            if metrics:
                bar.set_postfix({**postfix, **metrics.postfix()}, refresh=False)
            bar.update()
            if i + per_rank >= len(order):   # end of the epoch
                scheduler.step()
                stats = ht.average_metrics({"loss": float(np.mean(losses))})                  # hpctrain
                postfix = {"epoch": sampler.epoch, "loss": f"{stats['loss']:.4f}"}
                bar.set_postfix(postfix)
                sampler.set_epoch(sampler.epoch + 1)
                losses = []
            if manager:
                manager.save(step, state)                                                     # hpctrain
    if manager:
        manager.close()                                                                       # hpctrain
    if metrics:
        metrics.close()                                                                       # hpctrain
    bar.close()
    elapsed = time.perf_counter() - start

    accuracy = evaluate(model, x_test, y_test, comm)
    digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
                            .tobytes()).hexdigest()
    identical = len(set(comm.allgather_object(digest))) == 1
    hosts = comm.allgather_object(socket.gethostname())
    summary = {"ranks": n, "epochs": args.epochs, "global_batch": args.global_batch,
               "test_accuracy": accuracy, "replicas_identical": identical, "train_seconds": elapsed,
               "steps": step, "hosts": hosts, "compression": optimizer.compression_stats() if compressor is not None else None}
    if rank == 0:
        print(f"test accuracy {accuracy:.4f} on {len(y_test)} images after {args.epochs} epochs "
              f"on {n} rank(s) in {elapsed:.1f} s; replicas identical: {identical}")
        if metrics:
            from hpctrain.observe.report import write_report
            summary["step_metrics"] = metrics.summary()
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
