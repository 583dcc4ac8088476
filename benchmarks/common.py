"""Shared pieces of the benchmark drivers: launching a worker under mpirun and reading its result."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence

CORES = len(os.sched_getaffinity(0))


def free_port() -> int:
    """Return a TCP port that is free on this machine now (for torch.distributed rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_worker(n: int, argv: List[str], timeout: float = 1800, gloo: bool = False, elastic: bool = False) -> dict:
    """Run ``python <argv>`` on ``n`` ranks; return the JSON rank 0 printed as ``RESULT {...}``.

    The command is ``hpctrain launch``'s: the venv's mpirun (oversubscribed
    when ``n`` exceeds the cores), or srun inside a Slurm allocation.  One
    thread per rank (OMP_NUM_THREADS=1), a fresh rendezvous port in BENCH_PORT.
    ``gloo``: ``horovodrun --gloo`` instead; ``elastic``: ``hpctrain launch --elastic``'s command.
    """
    from hpctrain.launcher.launch import build_command

    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_PORT=str(free_port()), TF_CPP_MIN_LOG_LEVEL="3")
    cmd = build_command(n, [sys.executable, *argv], env=env, gloo=gloo, elastic=elastic)
    return result_of(subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout), argv, n)


def result_of(out: subprocess.CompletedProcess, argv: Sequence[str], n: object = "all") -> dict:
    """The JSON a finished worker launch's rank 0 printed as ``RESULT {...}`` (raise with its output if none)."""
    for line in out.stdout.splitlines():
        if "RESULT {" in line:                  # (horovodrun puts "[0]<stdout>:" before it)
            return json.loads(line[line.index("RESULT {") + 7:])
    raise RuntimeError(f"{' '.join(map(str, argv))} at {n} ranks failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


def oversubscribed(n: int) -> str:
    """Return " (oversubscribed)" when ``n`` ranks exceed this machine's cores."""
    return " (oversubscribed)" if n > CORES else ""


def paired_windows(window: Callable[[str, int], float], peers: Sequence[str], windows: int, steps: int
                   ) -> Dict[str, List[float]]:
    """Time ``window(peer, steps)`` for each peer, alternating which goes first; return {peer: [results]}.

    One warm-up window of 3 steps per peer first.  Alternating the order
    pairs the peers' windows in time, so a shared machine's slow moments hit
    both alike: read the results as per-pair ratios.
    """
    for peer in peers:
        window(peer, 3)
    out: Dict[str, List[float]] = {peer: [] for peer in peers}
    for w in range(windows):
        for peer in (peers if w % 2 == 0 else list(peers)[::-1]):
            out[peer].append(window(peer, steps))
    return out


def write_results(out: Path, name: str, data: dict, table: str, draw: Callable, dpi: int = 100) -> None:
    """Write a benchmark's results: ``name``.json (``data``), ``name``.md (``table``, also printed), ``name``.png.

    ``draw(plt)`` makes the figure with matplotlib's pyplot (Agg backend, no
    display needed) and returns it.  ``out`` is created if missing.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw(plt)
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=dpi)
    plt.close(fig)
    print(f"wrote {out / name}.json, {name}.md and {name}.png", flush=True)
