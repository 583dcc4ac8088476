"""Data-parallel training across real (namespace) nodes: hpctrain against torch DDP (gloo) and Horovod, same link.

Needs root: ``scripts/cluster.sh`` builds 2 nodes (own network namespace,
hostname, /dev/shm and /tmp; one link each to a bridge, shaped with tc tbf to
``--rate``).  One rank per node trains ``--model`` (default: the CNN of
examples/torch_digits.py at its batch of 24 per rank) with the worker of
``benchmarks/scaling.py``; each peer in its own mpirun launch from node1,
peers alternating their order between rounds:

* ``hpctrain``     ``hpctrain.torch.DistributedOptimizer`` (MPI backend);
* ``ddp``          ``DistributedDataParallel`` over gloo (rendezvous at node1);
* ``horovod``      ``horovod.torch.DistributedOptimizer`` (Horovod's MPI controller);
* ``independent``  every rank trains alone: the step without communication, the floor.

Every launch gets what the nodes need on one shared machine: one thread per
rank and Open MPI told to sleep while it waits (``OMPI_MCA_mpi_yield_when_idle``,
the README's advice for ``cluster.sh``).  A peer's step time is the median over
its timed windows and rounds; the headline is hpctrain's step over the faster
of DDP's and Horovod's.

    sudo .venv/bin/python benchmarks/multinode_training.py --out results/multinode-training
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, write_results  # noqa: E402
from multinode import Nodes  # noqa: E402
from scaling import DIGITS_BATCH, MODELS  # noqa: E402

SCALING = str(Path(__file__).resolve().parent / "scaling.py")
PEERS = ("hpctrain", "ddp", "horovod", "independent")
BATCHES = dict(MODELS, digits=DIGITS_BATCH)


def measure(args) -> dict:
    """Run every peer ``args.rounds`` times on 2 nodes x ``args.per_node`` ranks; return the raw step times."""
    nodes = Nodes(2, args.rate)
    batch = BATCHES[args.model]
    ranks = 2 * args.per_node
    steps = {p: [] for p in args.peers}
    try:
        link = nodes.link_gbit()
        for r in range(args.rounds):
            for peer in (args.peers if r % 2 == 0 else args.peers[::-1]):
                res = nodes.launch(2, [SCALING, "--worker", peer, "--model", args.model, "--steps", args.steps,
                                       "--windows", args.windows],
                                   per_node=args.per_node, timeout=900, BENCH_MASTER="198.18.0.1",
                                   BENCH_PORT=str(free_port()),
                                   OMPI_MCA_threads_pthreads_yield_strategy="nanosleep")
                steps[peer] += [ranks * batch / t for t in res["throughput"][args.model]]
                print(f"round {r} {peer}: median step {statistics.median(steps[peer][-args.windows:]) * 1e3:.2f} ms",
                      flush=True)
    finally:
        nodes.down()
    return {"model": args.model, "batch_per_rank": batch, "ranks": ranks, "per_node": args.per_node,
            "rate": args.rate, "link_gbit": link, "step_s": steps}


def write_outputs(data: dict, out: Path) -> None:
    med = {p: statistics.median(v) for p, v in data["step_s"].items()}
    peers = [p for p in ("ddp", "horovod") if p in med]
    best = min(peers, key=med.get) if peers else None
    data["median_step_s"] = med
    if best and "hpctrain" in med:
        data["hpctrain_over_best_peer"] = med["hpctrain"] / med[best]
    lines = [f"`{data['model']}` (batch {data['batch_per_rank']} per rank), 2 namespace nodes x {data['per_node']} "
             f"rank(s), links shaped to {data['rate']} (one TCP stream measured {data['link_gbit']:.2f} Gbit/s); "
             f"median step over windows and rounds", "",
             "| peer | median step (ms) | min..max (ms) | / independent (no communication) |", "|---|---|---|---|"]
    for p, v in data["step_s"].items():
        floor = med.get("independent")
        lines.append(f"| {p} | {med[p] * 1e3:.2f} | {min(v) * 1e3:.2f}..{max(v) * 1e3:.2f} | "
                     f"{med[p] / floor:.2f} |" if floor else f"| {p} | {med[p] * 1e3:.2f} | | |")
    if "hpctrain_over_best_peer" in data:
        lines += ["", f"hpctrain's step / the faster peer's ({best}): {data['hpctrain_over_best_peer']:.2f}"]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(data["step_s"])
        ax.boxplot([[s * 1e3 for s in data["step_s"][p]] for p in names], tick_labels=names)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("step time, ms")
        ax.set_title(f"{data['model']} across 2 namespace nodes ({data['rate']})", fontsize=10)
        return fig

    write_results(out, "multinode_training", data, "\n".join(lines), draw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="digits", choices=sorted(BATCHES))
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--per-node", type=int, default=1)
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=5, help="timed windows per launch")
    ap.add_argument("--out", default="results/multinode-training")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/multinode_training.py builds network and mount namespaces: run it as root")
    write_outputs(measure(args), Path(args.out))


if __name__ == "__main__":
    main()
