"""Asynchronous parameter-server training with torch: servers hold the parameters, workers push and pull.

Run with ``hpctrain launch --elastic -n 4 examples/parameter_server.py --staleness 2``: rank 3 serves, ranks
0-2 train, none waits for another more than ``--staleness`` steps.  ``--kill R:S``: rank R kills itself
(SIGKILL) at step S; a lost worker does not stop the others, a lost server ends the job, and the same command
run again resumes from the servers' checkpoint (``--checkpoint-dir``).  Worker 0 prints the loss, and with
``--out F`` saves the final parameters (safetensors) and a JSON summary next to them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch

import hpctrain
import hpctrain.torch as ht


def make_model() -> torch.nn.Module:
    """A two-layer perceptron (float64), the same on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).double()


def batch(worker: int, step: int, size: int):
    """Worker ``worker``'s batch at ``step`` of a regression task (a fixed teacher; the same on a rerun)."""
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = torch.randn(size, 32, generator=torch.Generator().manual_seed(10_000 * worker + step), dtype=torch.float64)
    return x, (x @ teacher).tanh()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps per worker")
    p.add_argument("--batch", type=int, default=16, help="samples per worker and step")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--staleness", type=int, default=1, help="the bound S (-1: none)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument("--compression", default=None, help="a compressor name for the pushes (fp16, topk, ...)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--kill", action="append", default=[], metavar="RANK:STEP",
                   help="the rank that kills itself at this step (a server: when worker 0 reaches it)")
    p.add_argument("--slow", type=float, default=0.0, metavar="S", help="the last worker sleeps S s a step")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    comm = hpctrain.init()
    pids = comm.allgather_object(os.getpid())
    kills = {int(r): int(s) for r, s in (k.split(":") for k in args.kill)}
    model = make_model()
    ps = ht.ParameterServer(model, lr=args.lr, momentum=args.momentum, servers=args.servers,
                            staleness=None if args.staleness < 0 else args.staleness, compression=args.compression,
                            checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    if ps.is_server:
        ps.serve()
        return
    w, start, loss = ps.worker_rank, time.perf_counter(), float("nan")
    for step in range(ps.start_step, args.steps):
        for rank, at in kills.items():
            if at == step and (rank == comm.rank or (w == 0 and rank in ps.roles.servers)):
                os.kill(pids[rank], signal.SIGKILL)       # (a server has no steps: worker 0 ends it)
        if args.slow and w == ps.num_workers - 1:
            time.sleep(args.slow)
        x, y = batch(w, step, args.batch)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        ps.step()
        if w == 0 and (step + 1) % 50 == 0:
            print(f"step {step + 1}: loss {loss.item():.5f}", flush=True)
    ps.finish()
    if args.out:
        from safetensors.torch import save_file

        out = f"{args.out}.worker{w}"
        save_file({n: t.detach().contiguous() for n, t in model.named_parameters()}, out)
        if w == 0:
            with open(f"{args.out}.json", "w") as f:
                json.dump({"start_step": ps.start_step, "steps": args.steps, "workers": ps.num_workers,
                           "global_steps": ps.global_steps,
                           "seconds": time.perf_counter() - start, "last_loss": loss.item()}, f)
    if w == 0:
        print(f"trained {args.steps - ps.start_step} steps from step {ps.start_step} on {ps.num_workers} workers "
              f"in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
