"""hpctrain.horovod: the last rank leaves with ``sys.exit(STATUS)`` while the others go on calling hvd.allreduce."""
import sys
import time

import torch

import hpctrain.horovod.torch as hvd

hvd.init()
for _ in range(5):
    hvd.allreduce(torch.ones(3), name="warm-up")
if hvd.rank() == 0:
    print("steps done", flush=True)
if hvd.rank() == hvd.size() - 1:
    print(f"rank {hvd.rank()} leaves early at {time.time():.3f}", flush=True)
    sys.exit(int(sys.argv[1]))
for _ in range(1000):
    hvd.allreduce(torch.ones(3), name="step")
    time.sleep(0.01)
