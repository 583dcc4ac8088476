"""Misbehave on one rank: ``die.py sigkill|raise|stall|return|exit|exit3|shutdown|mismatch VICTIM``; the others keep
calling allreduce (``mismatch``: the victim too, with one value more).

``return``, ``exit`` and ``shutdown`` leave early without an error (the script ends, ``sys.exit(0)``,
``hpctrain.shutdown()``), ``exit3`` with ``sys.exit(3)``; VICTIM -1: nobody misbehaves and every rank finishes the
same loop.
"""
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
    elif mode == "mismatch":
        x = np.ones(1001)
    elif mode == "raise":
        raise RuntimeError(f"boom on rank {comm.rank}")
    elif mode == "stall":
        if comm.size == 1:
            comm.recv(source=0, tag=99)  # nothing was sent: the receive stalls
        time.sleep(600)
    elif mode in ("return", "exit", "exit3", "shutdown"):
        print(f"rank {comm.rank} leaves early at {time.time():.3f}", flush=True)
        if mode.startswith("exit"):
            sys.exit(3 if mode == "exit3" else 0)
        if mode == "shutdown":
            hpctrain.shutdown()
leaves = comm.rank == victim and mode in ("return", "shutdown")   # the script ends: no Join, no error
for step in range(0 if leaves else 1000 if victim >= 0 else 20):
    comm.allreduce(x)
    time.sleep(0.01)
