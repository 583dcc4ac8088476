"""``hvd.elastic.run`` with a rank killed while the others run the collective of a request the negotiation had
agreed, for tests/test_horovod_elastic.py.

Each step all-reduces a tensor through ``hvd.allreduce`` and checks the sum (ranks 1..n, every element).  At
step ``--kill-step`` every rank starts one negotiated ``call`` request (the kind hpctrain.horovod's
DistributedOptimizer starts for a gradient bucket) whose payload, run once the negotiation agreed it, is an
all-reduce on the survivors and SIGKILL on the last rank: the survivors learn of the failure inside the
collective, not in a negotiation cycle.  Rank 0 writes one JSON line at the end: the size, the steps done, how
often ``train`` was entered.
"""
import argparse
import json
import os
import signal

import numpy as np
import torch

import hpctrain.horovod.torch as hvd
from hpctrain.horovod import basics

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--kill-step", type=int, default=2)
p.add_argument("--log", required=True)
args = p.parse_args()

hvd.init()
victim = int(os.environ["HOROVOD_RANK"]) == hvd.size() - 1
state = hvd.elastic.ObjectState(step=0, entered=0)


def die(comm):
    os.kill(os.getpid(), signal.SIGKILL)


@hvd.elastic.run
def train(state):
    state.entered += 1
    while state.step < args.steps:
        n = hvd.size()
        if state.step == args.kill_step and n == 3:
            x = np.ones(1 << 20, np.float32)
            basics.submit("call", f"bucket.{state.step}", None, ("allreduce_async",),
                          die if victim else (lambda comm: comm.allreduce(x, op="sum"))).wait()
        out = hvd.allreduce(torch.full((1000,), float(hvd.rank() + 1)), op=hvd.Sum, name=f"step.{state.step}")
        assert torch.all(out == n * (n + 1) / 2), (state.step, float(out[0]), n)
        state.step += 1
        state.commit()


train(state)
if hvd.rank() == 0:
    with open(args.log, "a") as f:
        f.write(json.dumps({"size": hvd.size(), "steps": state.step, "entered": state.entered}) + "\n")
