"""The Horovod-elastic peers of benchmarks/elastic.py: examples/elastic_train.py's model and data trained with
Horovod's elastic API, through the real Horovod 0.28.1 (``--api horovod``, started by ``horovodrun`` with a
host-discovery script) or through hpctrain.horovod (``--api hpctrain.horovod``, under ``hpctrain launch
--elastic``): the same script, one import apart.

``hvd.elastic.TorchState`` holds the model, the optimizer and the epoch's progress, committed every
``--commit-every`` steps; rank 0 prints ``step N`` after each step, ``resumed at step N`` in the reset
callback, and ``finished: N steps`` at the end.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from elastic_train import make_data, make_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--api", choices=["horovod", "hpctrain.horovod"], required=True)
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    hvd = importlib.import_module(f"{args.api}.torch")
    hvd.init()
    x, y = make_data(args.samples)
    model, opt = make_model()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, opt, epoch=0, step=0, processed=0)

    def on_reset():
        if hvd.rank() == 0:
            print(f"resumed at step {state.step}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        rank, size = hvd.rank(), hvd.size()
        while state.epoch < args.epochs:
            order = np.random.RandomState(3 + state.epoch).permutation(args.samples)
            rest = order[state.processed:]
            mine = rest[rank::size][:len(rest) // size]
            for b in range(len(mine) // args.batch):
                rows = torch.from_numpy(mine[b * args.batch:(b + 1) * args.batch])
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
                opt.step()
                state.processed += args.batch * size
                state.step += 1
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if rank == 0:
                    print(f"step {state.step}", flush=True)
                if state.step % args.commit_every == 0:
                    state.commit()
            state.epoch, state.processed = state.epoch + 1, 0
            state.commit()

    train(state)
    if hvd.rank() == 0:
        print(f"finished: {state.step} steps, world of {hvd.size()}", flush=True)


if __name__ == "__main__":
    main()
