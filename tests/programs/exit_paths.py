"""Break what runs at shutdown, then end: ``exit_paths.py WORKDIR failures explicit|atexit`` or ``WORKDIR straggler``.

``failures``: every writer that runs at shutdown fails on the rank that writes it: rank 0's timeline folder
(HPCTRAIN_TIMELINE=WORKDIR/timeline/trace.json, set by the caller) and metrics folder become files, the
checkpoint of step 1 cannot be committed (a file holds its final name), rank 0's stdout is closed before the
communication log's table (HPCTRAIN_COMM_LOG=1), and the last rank's own atexit hook raises.  ``explicit``
calls ``hpctrain.shutdown()``; ``atexit`` leaves it to the exit hook.
``straggler``: the last rank sleeps after the loop, outside any collective, so the others wait to leave.
"""
import atexit
import os
import shutil
import sys
import time

import numpy as np

import hpctrain
from hpctrain.checkpoint import CheckpointManager
from hpctrain.observe import StepMetrics

work, mode = sys.argv[1], sys.argv[2]
comm = hpctrain.init()
last = comm.size - 1
x = np.ones(1000)
for _ in range(5):
    comm.allreduce(x)

if mode == "straggler":
    if comm.rank == 0:
        print("steps done", flush=True)
    if comm.rank == last:
        time.sleep(600)
    sys.exit(0)

metrics_dir = os.path.join(work, "metrics")
metrics = StepMetrics(log_dir=metrics_dir, interval=10, resources=False, tensorboard=False)
for _ in range(3):
    comm.allreduce(x)
    metrics.mark(samples=1)               # 3 of a 10-step window: the rows are written at shutdown
manager = CheckpointManager(os.path.join(work, "ckpt"), async_save=True)
if comm.rank == 0:        # a dangling link holds the final name: the plan sees no checkpoint, the commit's rename fails
    os.symlink(os.path.join(work, "nowhere"), manager.step_dir(1))
manager.save(1, {"w": np.arange(10.0)})
if comm.rank == 0:
    for folder in (os.path.dirname(os.environ["HPCTRAIN_TIMELINE"]), metrics_dir):
        shutil.rmtree(folder)
        open(folder, "w").close()
    print("steps done", flush=True)
    sys.stdout.close()
if comm.rank == last:
    def boom():
        raise RuntimeError(f"boom in an atexit hook of rank {comm.rank}")
    atexit.register(boom)
if sys.argv[3] == "explicit":
    hpctrain.shutdown()
