"""The torchrun peer of benchmarks/elastic.py: DDP (gloo) training of examples/elastic_train.py's model and data,
checkpointed to disk every few steps and resumed from the newest checkpoint when torchrun restarts the workers.

Rank 0 prints ``step N`` after each step and ``resumed at step N`` after loading a checkpoint.  The checkpoint
(model, optimizer, epoch, step, samples consumed) is written by rank 0 with torch.save and an atomic rename.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from elastic_train import make_data, make_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--ckpt", required=True)
    args = p.parse_args()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The agent's store outlives a restart: the keys of each attempt get their own prefix (without it, the
    # restarted workers' gloo met the old attempt's addresses and timed out connecting).
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt-{attempt}", store), rank=rank, world_size=size)
    x, y = make_data(args.samples)
    model, opt = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    epoch, step, processed = 0, 0, 0
    if os.path.exists(args.ckpt):
        saved = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        epoch, step, processed = int(saved["epoch"]), int(saved["step"]), int(saved["processed"])
        if rank == 0:
            print(f"resumed at step {step}", flush=True)

    def save() -> None:
        if rank == 0:
            tmp = args.ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                        "step": step, "processed": processed}, tmp)
            os.replace(tmp, args.ckpt)

    while epoch < args.epochs:
        order = np.random.RandomState(3 + epoch).permutation(args.samples)
        rest = order[processed:]
        mine = rest[rank::size][:len(rest) // size]
        for b in range(len(mine) // args.batch):
            rows = torch.from_numpy(mine[b * args.batch:(b + 1) * args.batch])
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
            opt.step()
            processed += args.batch * size
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if rank == 0:
                print(f"step {step}", flush=True)
            if step % args.commit_every == 0:
                save()
        epoch, processed = epoch + 1, 0
        save()
    if rank == 0:
        print(f"finished: {step} steps, world of {size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
