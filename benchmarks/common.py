"""Shared pieces of the benchmark drivers: launching a worker under mpirun and reading its result."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

CORES = len(os.sched_getaffinity(0))


def free_port() -> int:
    """Return a TCP port that is free on this machine now (for torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_worker(n: int, argv: List[str], timeout: float = 1800) -> dict:
    """Run ``python <argv>`` on ``n`` ranks under the venv's mpirun; return the JSON rank 0 printed as ``RESULT {...}``.

    One thread per rank (OMP_NUM_THREADS=1), oversubscription when ``n``
    exceeds the cores, a fresh rendezvous port in BENCH_PORT.
    """
    cmd = [str(Path(sys.executable).parent / "mpirun"), "-n", str(n), "--bind-to", "none", "--mca", "osc", "^ucx"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if n > CORES:
        cmd.append("--oversubscribe")
    cmd += [sys.executable, *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_PORT=str(free_port()), TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{' '.join(argv)} at {n} ranks failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def oversubscribed(n: int) -> str:
    """Return " (oversubscribed)" when ``n`` ranks exceed this machine's cores."""
    return " (oversubscribed)" if n > CORES else ""
