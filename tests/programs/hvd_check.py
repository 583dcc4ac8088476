"""Check a Horovod-launched world: backend, size from Slurm, a sum over ranks against its formula."""
import os
import socket

import numpy as np

import hpctrain

comm = hpctrain.init()
n = comm.size
expected = int(os.environ.get("SLURM_NTASKS", n))
total = comm.allreduce(np.array([comm.rank + 1.0]))[0]
hosts = comm.allgather_object(socket.gethostname())
ok = comm.backend == "horovod" and n == expected and total == n * (n + 1) / 2
if comm.rank == 0:
    print(f"backend {comm.backend} size {n} (Slurm tasks {expected}) sum {total:g}: {'OK' if ok else 'WRONG'}",
          flush=True)
    print(f"hosts {','.join(hosts)}", flush=True)
hpctrain.shutdown()
raise SystemExit(0 if ok else 1)
