"""``hpctrain tune``: measure where the shared-memory and hierarchical all-reduce start to pay, save the thresholds.

``hpctrain tune -n N`` starts N ranks on this machine (or in the current
Slurm allocation, where several nodes make the hierarchical threshold
meaningful).  For message sizes from 1 KiB to 16 MiB each rank times the
library's all-reduce ("native") against "shm" (one node) or "hierarchical"
(several nodes), alternating them, and takes medians.  The threshold is the
smallest size from which hpctrain's algorithm is at least as fast at that
size and every larger one.  The result goes to :func:`hpctrain.comm.life.runtime.tuning_path`
(``~/.config/hpctrain/tune.json``, or HPCTRAIN_TUNE_FILE), which ``init()``
reads; environment variables (HPCTRAIN_SHM_MIN_BYTES, ...) still win.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

import numpy as np

__all__ = ["run_tune", "crossover"]

SIZES = [1024 << (2 * i) for i in range(8)]   # 1 KiB .. 16 MiB by x4


def crossover(native: Dict[int, float], ours: Dict[int, float], default: int) -> int:
    """Return the smallest size from which ``ours`` is no slower than ``native`` at it and every larger size.

    Returns the largest size measured times two when ours never catches up,
    and ``default`` when nothing was measured.
    """
    sizes = sorted(native)
    if not sizes:
        return default
    best = None
    for s in reversed(sizes):
        if ours[s] <= native[s]:
            best = s
        else:
            break
    return best if best is not None else 2 * sizes[-1]


def _worker(rounds: int) -> None:
    import hpctrain

    comm = hpctrain.init("mpi")
    ours = "shm" if comm.topology.num_nodes == 1 else "hierarchical"
    times: Dict[str, Dict[int, List[float]]] = {"native": {}, ours: {}}
    for nbytes in SIZES:
        x = np.ones(nbytes // 4, dtype=np.float32)
        iters = max(5, min(200, int(2e8 / nbytes)))
        for rnd in range(rounds):
            for alg in (("native", ours) if rnd % 2 == 0 else (ours, "native")):
                comm.allreduce(x, algorithm=alg)
                samples = []
                for _ in range(iters):
                    comm.barrier()
                    t0 = time.perf_counter()
                    comm.allreduce(x, algorithm=alg)
                    samples.append(time.perf_counter() - t0)
                # the slowest rank decides how long a collective takes
                times[alg].setdefault(nbytes, []).append(comm.allreduce(np.array([statistics.median(samples)]),
                                                                        op="max")[0])
    if comm.rank == 0:
        med = {alg: {s: statistics.median(v) for s, v in d.items()} for alg, d in times.items()}
        print("RESULT " + json.dumps({"algorithm": ours, "nodes": comm.topology.num_nodes, "ranks": comm.size,
                                      "times": med}), flush=True)
    hpctrain.shutdown()


def run_tune(n: int, out: str = "", rounds: int = 3) -> dict:
    """Measure on ``n`` ranks, write the tuning file and return what was written."""
    from ..comm.life.runtime import Config, tuning_path
    from .launch import build_command

    if n < 2:
        raise ValueError("tuning needs at least 2 ranks (-n 2 or more)")
    path = out or tuning_path()
    with tempfile.TemporaryDirectory(prefix="hpctrain-tune-") as tmp:
        # the ranks must not read an old (perhaps malformed) tuning file
        env = dict(os.environ, HPCTRAIN_TUNE_FILE=os.path.join(tmp, "none.json"))
        cmd = build_command(n, [sys.executable, "-m", "hpctrain.launcher.tune", "--worker", str(rounds)], env=env)
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"the tuning run failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    result = json.loads(lines[-1][7:])
    times = {alg: {int(s): t for s, t in d.items()} for alg, d in result["times"].items()}
    key = "shm_min_bytes" if result["algorithm"] == "shm" else "hierarchical_min_bytes"
    default = getattr(Config(), key)
    data = {
        "thresholds": {key: crossover(times["native"], times[result["algorithm"]], default)},
        "measured_on": {"host": socket.gethostname(), "ranks": result["ranks"], "nodes": result["nodes"],
                        "date": time.strftime("%Y-%m-%dT%H:%M:%S")},
        "times_s": {alg: {str(s): t for s, t in d.items()} for alg, d in times.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = path + ".tmp"
    with open(tmp_path, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp_path, path)
    data["path"] = path
    return data


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]))
