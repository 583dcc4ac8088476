"""Synchronous all-reduce against local SGD and DiLoCo, with and without a straggler (digits, torch).

One launch a mode and scenario, ``--ranks`` ranks: a 64-128-10 perceptron on scikit-learn's digits (1437
training images, 360 held out), Adam (lr 2e-3) as the (inner) optimizer, ``--batch`` samples a rank and step,
``--epochs`` epochs.  The compute of a step is made measurable on a shared machine by a sleep of
``--compute-s`` a step on every rank; with ``--scenario straggler`` rank ``ranks - 1`` sleeps twice that (a 2x
slower rank).  Modes: ``sync`` (DistributedOptimizer: gradients averaged every step), ``local4``, ``local16``
(LocalSGDOptimizer, parameters averaged every 4 / 16 steps), ``diloco16`` (outer SGD-Nesterov lr 0.7, momentum
0.9, every 16 steps).  Measured: samples/s over the run, the held-out accuracy of rank 0's parameters after
each epoch against wall time, time to reach ``--target`` accuracy, bytes a rank sent a step (the comm log).
Medians over ``--repeats`` launches, modes alternating.  ``--nodes 2`` runs on namespace nodes of
scripts/cluster.sh (1 Gbit/s links) and also counts the bytes the nodes' links carried during training.  Not
here yet: the backup-worker and parameter-server modes of issue 47.

    python benchmarks/sync_vs_async.py --ranks 4 --repeats 3 --out results/sync_vs_async
    sudo .venv/bin/python benchmarks/sync_vs_async.py --nodes 2 --ranks 4 --repeats 1 --out results/sync_vs_async_nodes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CORES, launch_worker, oversubscribed, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODES = {"sync": None, "local4": (4, None), "local16": (16, None), "diloco16": (16, 0.7)}


def link_tx() -> int:
    """Bytes this node's eth0 has sent (a namespace node's own link; 0 where there is none)."""
    with open("/proc/net/dev") as f:          # (this process's network namespace; /sys shows the mounter's)
        for line in f:
            name, _, counts = line.partition(":")
            if name.strip() == "eth0":
                return int(counts.split()[8])     # (8 receive fields, then transmitted bytes)
    return 0


def worker(mode: str, epochs: int, batch: int, compute_s: float, straggler: bool) -> None:
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    import hpctrain
    import hpctrain.torch as ht

    comm = hpctrain.init()
    torch.manual_seed(0)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    order = np.random.RandomState(0).permutation(len(x))
    train, test = order[:1437], order[1437:]
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    inner = torch.optim.Adam(model.parameters(), lr=2e-3)
    if MODES[mode] is None:
        opt = ht.DistributedOptimizer(inner, model.named_parameters())
    else:
        every, outer = MODES[mode]
        opt = ht.LocalSGDOptimizer(inner, model.named_parameters(), sync_every=every, outer_lr=outer)
    slow = 2.0 if straggler and comm.rank == comm.size - 1 else 1.0
    log = comm.comm_log
    log.start()
    comm.barrier()
    log.clear()
    tx0 = link_tx()
    start, curve, steps = time.perf_counter(), [], 0
    for epoch in range(epochs):
        perm = train[np.random.RandomState(1 + epoch).permutation(len(train))]
        mine = perm[comm.rank::comm.size][:len(perm) // comm.size]
        for b in range(len(mine) // batch):
            rows = torch.from_numpy(mine[b * batch:(b + 1) * batch])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            time.sleep(compute_s * slow)          # (the step's compute: measurable, and 2x on the straggler)
            opt.step()
            steps += 1
        if comm.rank == 0:
            with torch.no_grad():
                acc = float((model(x[test]).argmax(1) == y[test]).float().mean())
            curve.append([time.perf_counter() - start, acc])
    comm.barrier()
    wall = time.perf_counter() - start
    sent = log.totals()[1]
    import socket

    nodes = dict((host, tx) for host, tx in comm.allgather_object((socket.gethostname(), link_tx() - tx0)))
    if comm.rank == 0:
        print("RESULT " + json.dumps({"mode": mode, "wall_s": wall, "samples_per_s": steps * batch * comm.size / wall,
                                      "curve": curve, "bytes_per_step": sent / steps, "steps": steps,
                                      "link_bytes_per_step": sum(nodes.values()) / steps}), flush=True)
    hpctrain.shutdown()


def time_to(curve, target: float):
    """Seconds until the held-out accuracy first reached ``target`` (None if never)."""
    return next((t for t, acc in curve if acc >= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--straggler", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--compute-s", type=float, default=0.02)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--target", type=float, default=0.95, help="held-out accuracy for the time-to-accuracy column")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nodes", type=int, default=0, help="run on this many namespace nodes (scripts/cluster.sh, "
                   "1 Gbit/s links, needs root), ranks spread evenly; the bytes on the links are counted")
    p.add_argument("--out", type=Path, default=REPO / "results" / "sync_vs_async")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.epochs, args.batch, args.compute_s, args.straggler)
        return
    runs = []
    cluster = None
    if args.nodes:
        from multinode import Nodes

        cluster = Nodes(args.nodes, "1gbit")
    try:
        for r in range(args.repeats):
            for scenario in ("none", "straggler"):
                for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
                    runs.append(one_run(args, mode, scenario, cluster))
    finally:
        if cluster is not None:
            cluster.down()
    write_outputs(runs, args)


def one_run(args, mode: str, scenario: str, cluster) -> dict:
    """One launch of ``mode`` in ``scenario`` (on the namespace nodes when ``cluster``)."""
    argv = [__file__, "--worker", mode, "--epochs", str(args.epochs), "--batch", str(args.batch),
            "--compute-s", str(args.compute_s)] + (["--straggler"] if scenario == "straggler" else [])
    if cluster is not None:
        res = cluster.launch(args.nodes, argv, timeout=1200, per_node=args.ranks // args.nodes)
    else:
        res = launch_worker(args.ranks, argv, timeout=1200)
    res.update(scenario=scenario, time_to_target_s=time_to(res["curve"], args.target),
               final_accuracy=res["curve"][-1][1])
    print(json.dumps({k: v for k, v in res.items() if k != "curve"}), flush=True)
    return res


def write_outputs(runs, args) -> None:
    rows = []
    for scenario in ("none", "straggler"):
        for mode in args.modes:
            mine = [r for r in runs if r["mode"] == mode and r["scenario"] == scenario]
            reached = [r["time_to_target_s"] for r in mine if r["time_to_target_s"] is not None]
            rows.append({"scenario": scenario, "mode": mode,
                         "samples_per_s": statistics.median(r["samples_per_s"] for r in mine),
                         "final_accuracy": statistics.median(r["final_accuracy"] for r in mine),
                         "time_to_target_s": statistics.median(reached) if len(reached) == len(mine) else None,
                         "bytes_per_step": statistics.median(r["bytes_per_step"] for r in mine),
                         "link_bytes_per_step": statistics.median(r.get("link_bytes_per_step", 0) for r in mine),
                         "wall_s": statistics.median(r["wall_s"] for r in mine)})
    base = {s: next(r for r in rows if r["scenario"] == s and r["mode"] == "sync") for s in ("none", "straggler")
            } if "sync" in args.modes else {}
    where = (f" on {args.nodes} namespace nodes (1 Gbit/s links; the links' bytes are both directions' eth0 "
             f"counts, all traffic)" if args.nodes else "")
    lines = [f"digits, {args.ranks} ranks{oversubscribed(args.ranks)}{where}, {args.epochs} epochs, batch {args.batch} a "
             f"rank, {args.compute_s * 1e3:.0f} ms of compute (sleep) a step, the straggler 2x; medians of "
             f"{args.repeats} launches ({CORES}-core machine).\n",
             f"| scenario | mode | samples/s | x sync (same scenario) | held-out accuracy | time to "
             f"{args.target:.0%} | bytes a rank sent a step | x fewer than sync |"
             + (" bytes on the links a step | x fewer than sync |" if args.nodes else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if args.nodes else "")]
    for r in rows:
        ref = base.get(r["scenario"])
        speed = f"{r['samples_per_s'] / ref['samples_per_s']:.2f}x" if ref else "-"
        fewer = f"{ref['bytes_per_step'] / r['bytes_per_step']:.1f}x" if ref and r["bytes_per_step"] else "-"
        reach = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] is not None else "not reached"
        link = ""
        if args.nodes:
            cut = (f"{ref['link_bytes_per_step'] / r['link_bytes_per_step']:.1f}x"
                   if ref and r["link_bytes_per_step"] else "-")
            link = f" {r['link_bytes_per_step'] / 1e3:.1f} kB | {cut} |"
        lines.append(f"| {r['scenario']} | {r['mode']} | {r['samples_per_s']:.0f} | {speed} | "
                     f"{r['final_accuracy']:.3f} | {reach} | {r['bytes_per_step'] / 1e3:.1f} kB | {fewer} |{link}")
    table = "\n".join(lines)

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
        for ax, scenario in zip(axes, ("none", "straggler")):
            for mode in args.modes:
                run = next(r for r in runs if r["mode"] == mode and r["scenario"] == scenario)
                t, acc = zip(*run["curve"])
                ax.plot(t, acc, marker=".", label=mode)
            ax.set_title("no straggler" if scenario == "none" else "one rank 2x slower")
            ax.set_xlabel("wall time (s)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("held-out accuracy")
        axes[0].legend()
        return fig

    write_results(args.out, "sync_vs_async", {"rows": rows, "runs": runs, "cores": CORES,
                                              "args": {k: (str(v) if isinstance(v, Path) else v)
                                                       for k, v in vars(args).items()}}, table, draw)


if __name__ == "__main__":
    main()
