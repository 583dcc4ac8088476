"""Synchronous all-reduce against local SGD, DiLoCo, backup workers and parameter servers, with and without a
straggler (digits, torch).

One launch a mode and scenario, ``--ranks`` training ranks: a 64-128-10 perceptron on scikit-learn's digits
(1437 training images, 360 held out), ``--batch`` samples a rank and step, ``--epochs`` epochs' worth of
steps.  The compute of a step is made measurable on a shared machine by a sleep of ``--compute-s`` a step on
every rank; in the straggler scenario the last training rank takes twice as long for all of a step's compute
(twice the sleep, and its real compute time again as a sleep).
Modes: ``sync`` (DistributedOptimizer, Adam lr 2e-3: gradients averaged every step), ``sync-sgd`` (the same
with SGD, ``--sgd`` lr 0.1, momentum 0.9: local SGD's too), ``local4``,
``local16`` (LocalSGDOptimizer over that SGD, parameters averaged every 4 / 16 steps), ``diloco16`` (over Adam,
DiLoCo's outer SGD-Nesterov lr 0.7, momentum 0.9, every 16 steps), ``local16s``, ``diloco16s`` (the same in
rounds of 16 steps' compute time, ``sync_every_s``: a fast rank does more local steps than a straggler),
``local16s-adam`` (plain averaging in rounds over Adam: what DiLoCo's outer step adds); with one more rank as
the parameter server (SGD, ``--server-sgd`` lr 0.3, momentum 0.7: the same lr / (1 - momentum), less momentum
as asynchrony adds its own): ``backup1``
(synchronous steps that drop the last gradient to arrive), ``ps0``, ``ps1``, ``ps4`` (staleness bound 0, 1,
4), ``ps-async`` (no bound).  The step-counted modes deal each rank its share of every epoch; the modes in
rounds and the parameter-server modes stop at the same global number of applied gradients, each worker drawing from its own
passes over the data, so a fast worker does more of them than a slow one.  The modes other than the two
synchronous ones train on for ``--reach-x`` times the synchronous modes' budget (default 2), so that the time
they need to reach synchronous training's accuracy can be seen.  Measured: samples/s (gradients applied, all
ranks), the held-out accuracy of rank 0's parameters after each epoch's worth against wall time (the accuracy
column: after ``--epochs`` epochs' worth, the same budget for every mode), time to reach the accuracy of
synchronous training without the straggler (``sync`` for the Adam modes, ``sync-sgd`` for the SGD ones: local
SGD, the parameter servers and the backup worker) as a multiple of that run's wall time, bytes a (training) rank sent
a step.  Medians over ``--repeats``
launches, modes alternating.  ``--nodes 2`` runs on namespace nodes of scripts/cluster.sh (1 Gbit/s links)
and also counts the bytes the nodes' links carried during training (the synchronous and local modes).

    python benchmarks/sync_vs_async.py --ranks 4 --repeats 3 --out results/sync_vs_async
    python benchmarks/sync_vs_async.py --modes sync-sgd ps-async --server-sgd 0.1 0.9 --out results/ps_sgd
    sudo .venv/bin/python benchmarks/sync_vs_async.py --nodes 2 --ranks 4 --repeats 1 --modes sync local16 \
        --out results/sync_vs_async_nodes
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CORES, launch_worker, oversubscribed, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODES = {"sync": None, "sync-sgd": None, "local4": (4, None), "local16": (16, None), "diloco16": (16, 0.7),
         "local16s": ("s", None), "diloco16s": ("s", 0.7), "local16s-adam": ("s", None)}
# ("s": rounds of 16 steps' compute time); the modes whose ranks step with SGD (--sgd), not Adam
SGD_INNER = ("sync-sgd", "local4", "local16", "local16s")
# parameter-server modes: (staleness bound, backup workers); one server rank besides the --ranks workers
PS_MODES = {"backup1": (0, 1), "ps0": (0, 0), "ps1": (1, 0), "ps4": (4, 0), "ps-async": (None, 0)}
# SGD's (lr, momentum): synchronous and local SGD's; the servers' (--server-sgd), the same lr / (1 - momentum) with
# less momentum, as a stale gradient already carries some (asynchrony acts as momentum, Mitliagkas et al. 2016)
SGD, SERVER_SGD = (0.1, 0.9), (0.3, 0.7)


def link_tx() -> int:
    """Bytes this node's eth0 has sent (a namespace node's own link; 0 where there is none)."""
    with open("/proc/net/dev") as f:          # (this process's network namespace; /sys shows the mounter's)
        for line in f:
            name, _, counts = line.partition(":")
            if name.strip() == "eth0":
                return int(counts.split()[8])     # (8 receive fields, then transmitted bytes)
    return 0


def worker(mode: str, epochs: float, batch: int, compute_s: float, straggler: bool, task: str,
           sgd, server_sgd) -> None:
    """One launch's rank: train ``mode`` for ``epochs`` epochs' worth of steps (all ranks'), print the result."""
    import numpy as np
    import torch

    import hpctrain
    import hpctrain.torch as ht

    comm = hpctrain.init()
    if mode in PS_MODES:
        return ps_worker(comm, mode, epochs, batch, compute_s, straggler, task, server_sgd)
    torch.manual_seed(0)
    x, y, train, test, model = TASKS[task]()
    inner = (torch.optim.SGD(model.parameters(), lr=sgd[0], momentum=sgd[1]) if mode in SGD_INNER
             else torch.optim.Adam(model.parameters(), lr=2e-3))
    if MODES[mode] is None:
        opt = ht.DistributedOptimizer(inner, model.named_parameters())
    elif MODES[mode][0] == "s":
        opt = ht.LocalSGDOptimizer(inner, model.named_parameters(), sync_every_s=16 * compute_s,
                                   outer_lr=MODES[mode][1])
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
    if MODES[mode] is not None and MODES[mode][0] == "s":      # rounds of a time: a global budget, own passes
        per_epoch, batches = (len(train) // comm.size // batch) * comm.size, own_batches(train, comm.rank, batch)
        while opt.local_sgd.global_steps < round(epochs * per_epoch):
            rows = torch.from_numpy(next(batches))
            opt.zero_grad()
            compute(model, x, y, rows, compute_s, slow)
            syncs = opt.local_sgd.syncs
            opt.step()
            steps += 1
            if comm.rank == 0 and opt.local_sgd.syncs > syncs and \
                    opt.local_sgd.global_steps // per_epoch > len(curve):
                curve.append([time.perf_counter() - start, accuracy(model, x, y, test),
                              opt.local_sgd.global_steps / per_epoch])
        applied = opt.local_sgd.global_steps
    else:
        for epoch in range(round(epochs)):
            perm = train[np.random.RandomState(1 + epoch).permutation(len(train))]
            mine = perm[comm.rank::comm.size][:len(perm) // comm.size]
            for b in range(len(mine) // batch):
                rows = torch.from_numpy(mine[b * batch:(b + 1) * batch])
                opt.zero_grad()
                compute(model, x, y, rows, compute_s, slow)
                opt.step()
                steps += 1
            if comm.rank == 0:
                curve.append([time.perf_counter() - start, accuracy(model, x, y, test), epoch + 1])
        applied = steps * comm.size
    comm.barrier()
    wall = time.perf_counter() - start
    sent = log.totals()[1]
    import socket

    nodes = dict((host, tx) for host, tx in comm.allgather_object((socket.gethostname(), link_tx() - tx0)))
    if comm.rank == 0:
        if MODES[mode] is not None and MODES[mode][0] == "s":
            curve.append([wall, accuracy(model, x, y, test), applied / per_epoch])
        print("RESULT " + json.dumps({"mode": mode, "wall_s": wall, "samples_per_s": applied * batch / wall,
                                      "curve": curve, "bytes_per_step": sent / steps, "steps": applied / comm.size,
                                      "link_bytes_per_step": sum(nodes.values()) / steps}), flush=True)
    hpctrain.shutdown()


def digits_task():
    """The digits task: inputs, labels, the training and held-out rows, a 64-128-10 perceptron (the same on every
    rank)."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    order = np.random.RandomState(0).permutation(len(x))
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    return x, torch.tensor(digits.target), order[:1437], order[1437:], model


def teacher_task():
    """A larger task: 24000 Gaussian inputs of 256 values labelled by a fixed random teacher (256-512-10, argmax),
    4000 held out; a 256-1024-1024-10 perceptron (1.32 M parameters, 5.3 MB of float32 gradients a step)."""
    import torch

    g = torch.Generator().manual_seed(7)
    x = torch.randn(24000, 256, generator=g)
    w1, w2 = torch.randn(256, 512, generator=g) / 16, torch.randn(512, 10, generator=g) / 22.6
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    rows = torch.arange(24000).numpy()
    return x, y, rows[:20000], rows[20000:], model


TASKS = {"digits": digits_task, "teacher": teacher_task}


def own_batches(train, who: int, batch: int):
    """Rank ``who``'s own passes over the training rows, a batch at a time, for ever (the modes with a global
    budget of steps, where a fast rank does more of them than a slow one)."""
    import numpy as np

    for passes in itertools.count():
        order = train[np.random.RandomState([who, passes]).permutation(len(train))]
        for b in range(len(order) // batch):
            yield order[b * batch:(b + 1) * batch]


def compute(model, x, y, rows, compute_s: float, slow: float) -> None:
    """A step's compute: the gradients of the batch ``rows``, then ``compute_s`` of sleep (measurable on a shared
    machine); ``slow`` times all of it on the straggler (it sleeps its real compute time again as well)."""
    import torch

    began = time.perf_counter()
    torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
    time.sleep(compute_s * slow + (slow - 1) * (time.perf_counter() - began))


def accuracy(model, x, y, rows) -> float:
    """The model's accuracy on ``rows``."""
    import torch

    with torch.no_grad():
        return float((model(x[rows]).argmax(1) == y[rows]).float().mean())


def ps_worker(comm, mode: str, epochs: float, batch: int, compute_s: float, straggler: bool, task: str,
              server_sgd) -> None:
    """A parameter-server mode: the last rank serves (SGD with ``server_sgd``'s lr and momentum), the others
    train."""
    import torch

    import hpctrain
    import hpctrain.torch as ht

    torch.manual_seed(0)
    x, y, train, test, model = TASKS[task]()
    staleness, backup = PS_MODES[mode]
    ps = ht.ParameterServer(model, lr=server_sgd[0], momentum=server_sgd[1], servers=1, staleness=staleness,
                            backup_workers=backup)
    if ps.is_server:
        ps.serve()
        hpctrain.shutdown()
        return
    w, workers = ps.worker_rank, ps.num_workers
    slow = 2.0 if straggler and w == workers - 1 else 1.0
    per_epoch = (len(train) // workers // batch) * workers       # (the synchronous modes' steps, all ranks')
    budget = round(epochs * per_epoch)        # a global budget: a fast worker does more of it than a slow one
    start, curve, steps, batches = time.perf_counter(), [], 0, own_batches(train, w, batch)
    while ps.global_steps < budget:
        rows = torch.from_numpy(next(batches))
        compute(model, x, y, rows, compute_s, slow)
        ps.step()
        steps += 1
        if w == 0 and ps.global_steps // per_epoch > len(curve):
            curve.append([time.perf_counter() - start, accuracy(model, x, y, test), ps.global_steps / per_epoch])
    pushed = ps.bytes_pushed
    ps.finish()
    wall = time.perf_counter() - start
    if w == 0:
        applied = ps.global_steps           # (after finish: every worker's gradients the servers applied)
        curve.append([wall, accuracy(model, x, y, test), applied / per_epoch])
        print("RESULT " + json.dumps({"mode": mode, "wall_s": wall, "samples_per_s": applied * batch / wall,
                                      "curve": curve, "bytes_per_step": pushed / steps, "steps": applied / workers,
                                      "link_bytes_per_step": 0}), flush=True)
    hpctrain.shutdown()


SYNCHRONOUS = ("sync", "sync-sgd")


def reference(mode: str) -> str:
    """The synchronous mode with ``mode``'s optimizer (SGD for the server modes and those of SGD_INNER, else
    Adam)."""
    return "sync-sgd" if mode in PS_MODES or mode in SGD_INNER else "sync"


def time_to(curve, target: float):
    """Seconds until the held-out accuracy first reached ``target`` (None if never)."""
    return next((point[0] for point in curve if point[1] >= target), None)


def accuracy_at(curve, epochs: float) -> float:
    """The held-out accuracy after ``epochs`` epochs' worth of steps (the last point if the run did fewer)."""
    return next((point[1] for point in curve if point[2] >= epochs - 1e-9), curve[-1][1])


def main() -> None:
    p = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()) + " The default run is every mode x 2 scenarios x "
        "3 repeats (78 launches); --modes and --repeats make it shorter.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--worker", choices=list(MODES) + list(PS_MODES), help=argparse.SUPPRESS)
    p.add_argument("--straggler", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4, help="training ranks (a parameter-server mode adds one server)")
    p.add_argument("--epochs", type=float, default=12, help="epochs' worth of steps of the synchronous modes")
    p.add_argument("--task", choices=list(TASKS), default="digits",
                   help="digits, or teacher: a larger one (1.32 M parameters)")
    p.add_argument("--batch", type=int, default=16, help="samples a rank and step")
    p.add_argument("--compute-s", type=float, default=0.02, help="seconds of compute (a sleep) a step on every rank")
    p.add_argument("--modes", nargs="+", default=list(MODES) + list(PS_MODES), choices=list(MODES) + list(PS_MODES),
                   metavar="MODE", help=f"the modes to run, of: {', '.join(list(MODES) + list(PS_MODES))}")
    p.add_argument("--reach-x", type=float, default=2.0, help="the non-synchronous modes train on for this many "
                   "times the synchronous modes' epochs (to see when they reach synchronous training's accuracy)")
    p.add_argument("--repeats", type=int, default=3, help="launches of each mode and scenario (medians)")
    p.add_argument("--sgd", type=float, nargs=2, default=SGD, metavar=("LR", "MOMENTUM"),
                   help="synchronous and local SGD's")
    p.add_argument("--server-sgd", type=float, nargs=2, default=SERVER_SGD, metavar=("LR", "MOMENTUM"),
                   help="the parameter servers' SGD")
    p.add_argument("--nodes", type=int, default=0, help="run on this many namespace nodes (scripts/cluster.sh, "
                   "1 Gbit/s links, needs root), ranks spread evenly; the bytes on the links are counted (0: none)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "sync_vs_async",
                   help="the folder for sync_vs_async.json, .md and .png")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.epochs, args.batch, args.compute_s, args.straggler, args.task, args.sgd,
               args.server_sgd)
        return
    if args.nodes and set(args.modes) & set(PS_MODES):
        p.error(f"--nodes runs the synchronous and local modes only (the parameter-server ones take one more rank "
                f"than the nodes split evenly): drop {', '.join(sorted(set(args.modes) & set(PS_MODES)))}")
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
    epochs = args.epochs * (1 if mode in SYNCHRONOUS else args.reach_x)
    argv = [__file__, "--worker", mode, "--task", args.task, "--epochs", str(epochs), "--batch", str(args.batch),
            "--compute-s", str(args.compute_s), "--sgd", *map(str, args.sgd), "--server-sgd",
            *map(str, args.server_sgd)] + (["--straggler"] if scenario == "straggler" else [])
    if cluster is not None:
        res = cluster.launch(args.nodes, argv, timeout=1200, per_node=args.ranks // args.nodes)
    else:       # (a parameter-server mode: one server rank besides the workers)
        res = launch_worker(args.ranks + (mode in PS_MODES), argv, timeout=1200)
    res.update(scenario=scenario, accuracy=accuracy_at(res["curve"], args.epochs),
               final_accuracy=res["curve"][-1][1])
    print(json.dumps({k: v for k, v in res.items() if k != "curve"}), flush=True)
    return res


def write_outputs(runs, args) -> None:
    ref = {}            # the synchronous modes without the straggler: their accuracy and wall time
    for mode in SYNCHRONOUS:
        mine = [r for r in runs if r["mode"] == mode and r["scenario"] == "none"]
        if mine:
            ref[mode] = (statistics.median(r["accuracy"] for r in mine), statistics.median(r["wall_s"] for r in mine))
    rows = []
    for scenario in ("none", "straggler"):
        for mode in args.modes:
            mine = [r for r in runs if r["mode"] == mode and r["scenario"] == scenario]
            reach = None
            if reference(mode) in ref:      # (seconds to the synchronous run's accuracy / its wall time; inf: never)
                acc, wall = ref[reference(mode)]
                reach = statistics.median((time_to(r["curve"], acc) or float("inf")) / wall for r in mine)
            rows.append({"scenario": scenario, "mode": mode,
                         "samples_per_s": statistics.median(r["samples_per_s"] for r in mine),
                         "accuracy": statistics.median(r["accuracy"] for r in mine),
                         "final_accuracy": statistics.median(r["final_accuracy"] for r in mine),
                         "reach_x": reach if reach != float("inf") else None, "reference": reference(mode),
                         "reached": reach is not None and reach != float("inf"),
                         "bytes_per_step": statistics.median(r["bytes_per_step"] for r in mine),
                         "link_bytes_per_step": statistics.median(r.get("link_bytes_per_step", 0) for r in mine),
                         "wall_s": statistics.median(r["wall_s"] for r in mine)})
    base = {s: next(r for r in rows if r["scenario"] == s and r["mode"] == "sync") for s in ("none", "straggler")
            } if "sync" in args.modes else {}
    where = (f" on {args.nodes} namespace nodes (1 Gbit/s links; the links' bytes are both directions' eth0 "
             f"counts, all traffic)" if args.nodes else "")
    refs = "; ".join(f"{m} {a:.1%} in {w:.1f} s" for m, (a, w) in ref.items())
    lines = [f"{args.task}, {args.ranks} ranks{oversubscribed(args.ranks)}{where}, {args.epochs:g} epochs (the "
             f"non-synchronous modes up to {args.epochs * args.reach_x:g}), batch {args.batch} a rank, "
             f"{args.compute_s * 1e3:.0f} ms of compute (sleep) a step, the straggler 2x; SGD lr, momentum "
             f"{args.sgd[0]:g}, {args.sgd[1]:g}, the servers' {args.server_sgd[0]:g}, {args.server_sgd[1]:g}; "
             f"medians of {args.repeats} "
             f"launches ({CORES}-core machine). Synchronous training without the straggler: {refs or '-'}.\n",
             f"| scenario | mode | samples/s | x sync (same scenario) | held-out accuracy after {args.epochs:g} "
             f"epochs | time to the synchronous run's accuracy (x its wall time without straggler) | bytes a rank "
             f"sent a step | x fewer than sync |" + (" bytes on the links a step | x fewer than sync |" if args.nodes else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|---|" if args.nodes else "")]
    for r in rows:
        base_r = base.get(r["scenario"])
        speed = f"{r['samples_per_s'] / base_r['samples_per_s']:.2f}x" if base_r else "-"
        fewer = f"{base_r['bytes_per_step'] / r['bytes_per_step']:.1f}x" if base_r and r["bytes_per_step"] else "-"
        reach = (f"{r['reach_x']:.2f}x ({r['reference']})" if r["reached"] else
                 "not reached" if r["reference"] in ref else "-")
        link = ""
        if args.nodes:
            cut = (f"{base_r['link_bytes_per_step'] / r['link_bytes_per_step']:.1f}x"
                   if base_r and r["link_bytes_per_step"] else "-")
            link = f" {r['link_bytes_per_step'] / 1e3:.1f} kB | {cut} |"
        lines.append(f"| {r['scenario']} | {r['mode']} | {r['samples_per_s']:.0f} | {speed} | "
                     f"{r['accuracy']:.3f} | {reach} | {r['bytes_per_step'] / 1e3:.1f} kB | {fewer} |{link}")
    table = "\n".join(lines)

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True)
        for ax, scenario in zip(axes, ("none", "straggler")):
            for i, mode in enumerate(args.modes):      # (10 distinct colours, then the same with dashes)
                run = next(r for r in runs if r["mode"] == mode and r["scenario"] == scenario)
                t, acc = list(zip(*run["curve"]))[:2]
                ax.plot(t, acc, marker=".", label=mode, color=plt.get_cmap("tab10")(i % 10),
                        linestyle="-" if i < 10 else "--")
            for name, style in (("sync", ":"), ("sync-sgd", "-.")):   # (the targets: synchronous training's
                if name in ref:                                         # accuracy within 2x its time)
                    ax.axhline(ref[name][0], color="grey", linestyle=style, linewidth=1,
                               label=f"{name}'s accuracy and 2x its time (no straggler)")
                    ax.axvline(2 * ref[name][1], color="grey", linestyle=style, linewidth=1)
            ax.set_title("no straggler" if scenario == "none" else "one rank 2x slower")
            ax.set_xlabel("wall time (s)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("held-out accuracy")
        low = min(p[1] for r in runs for p in r["curve"])     # (every point shown, the first epoch's too)
        axes[0].set_ylim(max(0.0, low - 0.02), 1.0)
        axes[1].legend(fontsize="small", loc="center left", bbox_to_anchor=(1.02, 0.5))    # (beside the data)
        return fig

    write_results(args.out, "sync_vs_async", {"rows": rows, "runs": runs, "cores": CORES,
                                              "args": {k: (str(v) if isinstance(v, Path) else v)
                                                       for k, v in vars(args).items()}}, table, draw)


if __name__ == "__main__":
    main()
