"""Misbehave on one rank: ``die.py sigkill|raise|stall VICTIM``; the other ranks keep calling allreduce."""
import os
import signal
import sys
import time

import numpy as np

import hpctrain

mode, victim = sys.argv[1], int(sys.argv[2])
comm = hpctrain.init()
x = np.ones(1000)
for step in range(20):
    comm.allreduce(x)
if comm.rank == 0:
    print("steps done", flush=True)
if comm.rank == victim:
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "raise":
        raise RuntimeError(f"boom on rank {comm.rank}")
    elif mode == "stall":
        if comm.size == 1:
            comm.recv(source=0, tag=99)  # nothing was sent: the receive stalls
        time.sleep(600)
for step in range(1000):
    comm.allreduce(x)
    time.sleep(0.01)
