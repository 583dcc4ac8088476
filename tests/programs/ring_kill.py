"""A rank killed (SIGKILL, from a timer) while every rank runs ring all-reduces back to back, so that the
survivors have messages to and from it in flight; the survivors re-form the world and go on.

Usage (under ``hpctrain launch --elastic -n N``): ``ring_kill.py KILL_AFTER_S ELEMENTS [ALGORITHM]`` (``ring`` by
default; ``native``: the library's ``MPI_Allreduce``, han across nodes).  The last rank of the
first world dies after KILL_AFTER_S seconds.  After the re-forming each survivor all-reduces its first-world rank
+ 1 over the new world and prints ``AFTER <sum> <size> KEPT <requests left allocated> CALLS <all-reduces before
the failure>``.
"""
import os
import signal
import sys
import threading

import numpy as np

import hpctrain
from hpctrain.comm.backends.mpi import requests
from hpctrain.elastic import reform
from hpctrain.errors import WorldFailedError

kill_after, elements = float(sys.argv[1]), int(sys.argv[2])
algorithm = sys.argv[3] if len(sys.argv) > 3 else "ring"
world = hpctrain.init()
first_rank, first_size = world.rank, world.size
if first_rank == first_size - 1:
    threading.Timer(kill_after, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
x = np.full(elements, float(first_rank + 1))
calls = 0
while world.size == first_size:
    try:
        got = world.allreduce(x, algorithm=algorithm)
        calls += 1
        assert got[0] == got[-1] == first_size * (first_size + 1) / 2, got[:3]
    except WorldFailedError:
        world, _ = reform()
after = world.allreduce(np.array([float(first_rank + 1)]), algorithm=algorithm)
print(f"AFTER {after[0]:g} {world.size} KEPT {len(requests._KEPT)} CALLS {calls}", flush=True)
