"""Elastic data-parallel training with torch: survives killed ranks and goes on at the new size.

Run with ``hpctrain launch --elastic -n 4 examples/elastic_train.py --kill 3:20`` (rank 3 kills itself with
SIGKILL at step 20; ``--kill`` may repeat): the survivors re-form the world, go back to the last commit and
finish the epochs, the epoch's unseen samples re-dealt over the new size.  Rank 0 prints the recoveries, and
with ``--out F`` saves the final parameters (safetensors) and a JSON summary next to them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import hpctrain
import hpctrain.elastic
import hpctrain.torch as ht


def make_data(samples: int):
    """A regression task: ``samples`` inputs of 32 values and their targets (float64, the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 32, generator=g, dtype=torch.float64)
    return x, (x @ torch.randn(32, 1, generator=g, dtype=torch.float64)).tanh()


def make_model():
    """The model (a two-layer perceptron, float64) and its local optimizer, the same on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--commit-every", type=int, default=1, help="steps between commits")
    p.add_argument("--kill", action="append", default=[], metavar="RANK:STEP",
                   help="the rank (of the first world it trains in: ranks that join a running world number on "
                        "from its ranks) that kills itself at this global step")
    p.add_argument("--kill-in-recovery", type=int, action="append", default=[], metavar="RANK",
                   help="the rank (of the first world) that kills itself during the first recovery it takes part in "
                        "(in its on_reform callback, while the others rebuild and agree on the commit)")
    p.add_argument("--stall", action="append", default=[], metavar="RANK:STEP",
                   help="the rank (of the first world) that stops itself (SIGSTOP: alive, but never answers) at this step")
    p.add_argument("--sleep-in-recovery", type=float, default=0.0, metavar="S",
                   help="every survivor sleeps S seconds in its on_reform callback (rank 0 prints 'recovering' first)")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep each step (to kill a node by hand)")
    p.add_argument("--zero", type=int, choices=(1, 2), help="shard the optimizer (ZeRO stage 1 or 2)")
    p.add_argument("--compression", choices=("fp16", "bf16"),
                   help="send the gradients in half precision (the compressors that keep no state between steps)")
    p.add_argument("--log-steps", action="store_true", help="rank 0 prints 'step N' after each step")
    p.add_argument("--out", help="file for the final parameters (.safetensors) and its .json summary")
    p.add_argument("--checkpoint-dir", help="also save checkpoints to disk here (every --checkpoint-every steps), "
                   "and start from the newest one found there (a requeued job)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between disk checkpoints")
    p.add_argument("--metrics-dir", help="per-step metrics here (steps.jsonl, ranks.jsonl, CSV): they follow the "
                   "re-formed worlds")
    args = p.parse_args()
    kills = {int(r): int(s) for r, s in (k.split(":") for k in args.kill)}
    stalls = {int(r): int(s) for r, s in (k.split(":") for k in args.stall)}

    torch.use_deterministic_algorithms(True)
    hpctrain.init()
    first_rank = []     # (the rank in the first world this process trains in: ranks that join later count on from it)
    x, y = make_data(args.samples)
    model, opt = make_model()
    if args.zero:       # (ZeRO: each rank holds its chunk of the momentum; a re-forming reshards it)
        opt = ht.ShardedOptimizer(opt, stage=args.zero, named_parameters=model.named_parameters())
    else:
        opt = ht.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=args.compression)
    sampler = hpctrain.elastic.ElasticSampler(args.samples, shuffle=True, seed=3)
    state = ht.TorchState(model, opt, sampler=sampler, epoch=0, step=0)
    if hpctrain.world().rank in args.kill_in_recovery and not hpctrain.elastic.joining():
        hpctrain.elastic.on_reform(lambda new_world: os.kill(os.getpid(), signal.SIGKILL))
    if args.sleep_in_recovery:
        def linger(new_world):
            if new_world.rank == 0:
                print("recovering", flush=True)
            time.sleep(args.sleep_in_recovery)
        hpctrain.elastic.on_reform(linger)
    manager = None
    if args.checkpoint_dir:         # (made without comm=: it follows the world through re-formings)
        from hpctrain.checkpoint import CheckpointManager

        manager = CheckpointManager(args.checkpoint_dir, every_steps=args.checkpoint_every)
        on_disk = {"model": model, "optimizer": opt, "sampler": sampler, "epoch": 0, "step": 0}
        if manager.restore(on_disk) is not None:
            state.epoch, state.step = on_disk["epoch"], on_disk["step"]
            state.save()

        def from_disk():        # (a re-forming that cannot rebuild the in-memory commit goes back to the disk)
            entries = {"model": model, "optimizer": opt, "sampler": state.sampler, "epoch": 0, "step": 0}
            step = manager.restore(entries)
            if step is None:
                raise RuntimeError(f"no disk checkpoint in {args.checkpoint_dir} to go back to")
            state.epoch, state.step = entries["epoch"], entries["step"]
            return step

        state.register_disk_fallback(from_disk)
    metrics = None
    if args.metrics_dir:
        from hpctrain.observe import StepMetrics

        metrics = StepMetrics(log_dir=args.metrics_dir, samples_per_step=args.batch, interval=4, tensorboard=False)
    resumed_at = []         # the step each re-forming went back to
    def went_back():
        resumed_at.append(state.step)
        if args.log_steps and hpctrain.world().rank == 0:
            print(f"resumed at step {state.step} (a reset)", flush=True)

    state.register_reset_callbacks([went_back])

    @hpctrain.elastic.run
    def train(state):
        if not first_rank:
            first_rank.append(hpctrain.world().rank)
        for state.epoch in range(state.epoch, args.epochs):
            idx = list(state.sampler)
            for b in range(len(idx) // args.batch):
                if kills.get(first_rank[0]) == state.step:
                    os.kill(os.getpid(), signal.SIGKILL)
                if stalls.get(first_rank[0]) == state.step:
                    os.kill(os.getpid(), signal.SIGSTOP)
                rows = idx[b * args.batch:(b + 1) * args.batch]
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                opt.step()
                state.sampler.record_batch(args.batch)
                state.step += 1
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if args.log_steps and hpctrain.world().rank == 0:
                    print(f"step {state.step}", flush=True)
                if metrics is not None:
                    metrics.mark()
                if state.step % args.commit_every == 0:
                    state.commit()
                if manager is not None:
                    manager.save(state.step, {"model": model, "optimizer": opt, "sampler": state.sampler,
                                              "epoch": state.epoch, "step": state.step})
            state.epoch += 1                    # (the commit at an epoch's end must say the next epoch: a
            state.sampler.set_epoch(state.epoch)  # re-forming that goes back to it starts there)
            state.commit()

    train(state)
    if manager is not None:
        manager.wait()
    if metrics is not None:
        metrics.close()
    w = hpctrain.world()
    if w.rank == 0:
        print(f"finished: {state.step} steps, world of {w.size}, {len(state.recoveries)} re-formings", flush=True)
        if args.out:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out)
            with open(args.out + ".json", "w") as f:
                json.dump({"steps": state.step, "size": w.size, "resumed_at": resumed_at,
                           "recoveries": state.recoveries, "marked": metrics.step if metrics else None}, f, indent=1)


if __name__ == "__main__":
    main()
