"""Deterministic data-parallel training with checkpoints, for the crash/preemption/restart tests.

An MLP with dropout on a fixed synthetic data set, DistributedSampler over a
fixed global batch, Adam + StepLR, a checkpoint every ``--every`` steps (sampler
position, RNG states and all).  At the end rank 0 writes the parameters to
``--out`` (npz).  Faults, injected for real in this process:

* ``--kill RANK:STEP``    rank RANK SIGKILLs itself after finishing step STEP;
* ``--signal RANK:STEP``  rank RANK sends itself SIGUSR2 after step STEP;
* ``--kill-in-write N``   rank 0 SIGKILLs itself half-way through writing its
  N-th checkpoint file (1-based).
"""
import argparse
import os
import signal
import time

import numpy as np
import torch
import torch.nn.functional as F

import hpctrain
import hpctrain.checkpoint.tensorfile as tensorfile
import hpctrain.torch as ht
from hpctrain.checkpoint import CheckpointManager, RNGState, Sharded, on_preemption
from hpctrain.data import DistributedSampler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slow runs)")
    ap.add_argument("--sync", action="store_true", help="synchronous saves")
    ap.add_argument("--kill")
    ap.add_argument("--signal")
    ap.add_argument("--kill-in-write", type=int)
    ap.add_argument("--stop-after", type=int, help="exit cleanly after this step (checkpoint included)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    comm = hpctrain.init()
    rank, size = comm.rank, comm.size
    if args.global_batch % size:
        raise SystemExit(f"--global-batch must be divisible by the {size} ranks")
    gen = torch.Generator().manual_seed(1234)
    data_x = torch.randn(200, 10, generator=gen)
    data_y = (data_x[:, :3].sum(1) > 0).long()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Dropout(args.dropout),
                                torch.nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    opt = ht.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    torch.manual_seed(100 + rank)                      # dropout differs per rank: its RNG must be restored
    sampler = DistributedSampler(len(data_x), seed=7, drop_last=True)
    state = {"model": model, "opt": opt, "sched": sched, "sampler": sampler,
             "rng": Sharded(RNGState(), missing="skip")}
    manager = CheckpointManager(args.ckpt, keep=2, every_steps=args.every, async_save=not args.sync)
    on_preemption(manager)
    if args.kill_in_write:
        _kill_in_write(args.kill_in_write, rank)
    step = manager.restore(state) or 0
    if rank == 0:
        print(f"starting at step {step}", flush=True)
    per_rank = args.global_batch // size
    kill = [int(v) for v in args.kill.split(":")] if args.kill else None
    sig = [int(v) for v in args.signal.split(":")] if args.signal else None
    indices, pos = sampler.indices(), 0
    while step < args.steps:
        if pos + per_rank > len(indices):       # epoch done
            sampler.set_epoch(sampler.epoch + 1)
            indices, pos = sampler.indices(), 0
            continue
        batch = indices[pos:pos + per_rank]
        pos += per_rank
        opt.zero_grad()
        F.cross_entropy(model(data_x[batch]), data_y[batch]).backward()
        opt.step()
        sched.step()
        sampler.advance(per_rank)
        step += 1
        if rank == 0 and args.step_sleep:
            print(f"step {step}", flush=True)
        time.sleep(args.step_sleep)
        if kill and kill == [rank, step]:
            os.kill(os.getpid(), signal.SIGKILL)
        if sig and sig == [rank, step]:
            os.kill(os.getpid(), signal.SIGUSR2)
        manager.save(step, state)
        if args.stop_after == step:
            break
    manager.close()
    if rank == 0:
        np.savez(args.out, step=step, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
        print(f"finished at step {step}", flush=True)
    hpctrain.shutdown()


def _kill_in_write(nth: int, rank: int) -> None:
    """Make rank 0 die by SIGKILL half-way through its nth checkpoint file."""
    real = tensorfile.write_tensors
    count = [0]

    def write(path, tensors, metadata=None):
        count[0] += 1
        if rank == 0 and count[0] == nth:
            half = dict(list(tensors.items())[: max(1, len(tensors) // 2)])
            real(path, half, metadata)             # a real, partial file on disk
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, tensors, metadata)

    import hpctrain.checkpoint.layout as layout     # where each rank's checkpoint files are written
    layout.write_tensors = write


if __name__ == "__main__":
    main()
