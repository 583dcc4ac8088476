"""A rank killed (SIGKILL, from a timer) while every rank runs ring all-reduces back to back, so that the
survivors have messages to and from it in flight; the survivors re-form the world and go on.

Usage (under ``hpctrain launch --elastic -n N``): ``ring_kill.py KILL_AFTER_S ELEMENTS [ALGORITHM]`` (the
all-reduce's algorithm: ``ring`` by default, ``auto``, ``native``; or ``broadcast`` / ``allgather``: those
collectives, from rank 0 and of ELEMENTS / N per rank, in place of the all-reduce).  The last rank of the
first world dies after KILL_AFTER_S seconds; every result before is checked.  After the re-forming each survivor
all-reduces its first-world rank + 1 over the new world and prints ``AFTER <sum> <size> KEPT <requests left
allocated> CALLS <calls before the failure>``.
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
        if algorithm == "broadcast":       # (a new value each call: a buffer left half-written shows)
            got = world.broadcast(x * (calls + 1) if first_rank == 0 else np.zeros(elements), root=0)
            assert got[0] == got[elements // 2] == got[-1] == calls + 1, (calls, got[:2], got[-2:])
        elif algorithm == "allgather":
            got = world.allgather(x[:elements // first_size] * (calls + 1))
            assert got[0] == calls + 1 and got[-1] == first_size * (calls + 1), (calls, got[:2], got[-2:])
        else:
            got = world.allreduce(x, algorithm=algorithm)
            assert got[0] == got[-1] == first_size * (first_size + 1) / 2, got[:3]
        calls += 1
    except WorldFailedError:
        world, _ = reform()
after = world.allreduce(np.array([float(first_rank + 1)]),
                        algorithm=algorithm if algorithm not in ("broadcast", "allgather") else "auto")
print(f"AFTER {after[0]:g} {world.size} KEPT {len(requests._KEPT)} CALLS {calls}", flush=True)
