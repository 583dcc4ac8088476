"""What an elastic commit costs: step time with ``state.commit()`` every k steps against no commit, same launch.

Each rank trains a model through ``hpctrain.torch.DistributedOptimizer`` (Adam: two moment tensors a
parameter, the larger state to copy) under ``hpctrain launch --elastic``, holding it in a
``hpctrain.torch.TorchState``.  Windows of ``--steps`` steps alternate between the intervals
(``--intervals``: 0 = never commit, k = commit after every k-th step; the order reversed every other
window, so a shared machine's slow moments hit all alike); the figure per interval is the median over
windows of (window time / the no-commit window's time of the same round) - 1: the share of step time that
committing costs.  ``commit`` is the median time of one ``state.commit()`` (the model's and the
optimizer's state dicts and the RNG states packed into host memory with their CRC-32: no communication; with
``--optimizers zero2`` a ShardedOptimizer's chunks are packed and copied to the buddy rank: one all-to-all).
The windows run inside ``hpctrain.elastic.run``, as a training function does, so each commit is also
written to the node's memory (``/dev/shm``) on the commit's helper thread; ``--node-local on off`` times
both (``HPCTRAIN_NODE_COMMITS``).

    python benchmarks/elastic_commit.py --ranks 2 4 --out results/elastic_commit

Models: ``mlp`` (6.3 M parameters) and ``resnet18`` (11.2 M), as in benchmarks/scaling.py.
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
from scaling import MODELS, build  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def worker(models, intervals, steps: int, windows: int, zero: bool = False) -> None:
    """Time windows of each interval for each model on this launch's ranks; rank 0 prints RESULT {...}."""
    import torch
    import torch.nn.functional as F

    import hpctrain
    import hpctrain.elastic
    import hpctrain.torch as ht

    torch.set_num_threads(1)
    world = hpctrain.init("mpi")
    results = {}
    for name in models:
        torch.manual_seed(0)
        model, shape, classes = build(name)
        adam = torch.optim.Adam(model.parameters(), lr=1e-4)
        opt = ht.ShardedOptimizer(adam, stage=2, named_parameters=model.named_parameters()) if zero else \
            ht.DistributedOptimizer(adam, named_parameters=model.named_parameters())
        batch = MODELS[name]
        x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
        state = ht.TorchState(model, opt, step=0)
        commits = []

        def window(every: int, n: int) -> float:
            world.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
                state.step += 1
                if every and state.step % every == 0:
                    state.commit()
                    commits.append(state.commit_s)
            world.barrier()
            return time.perf_counter() - t0

        times = {every: [] for every in intervals}

        @hpctrain.elastic.run
        def measure(state):         # (as a training function: its commits go where a user's go)
            for every in intervals:                     # warm-up (allocator, buckets, the first copies)
                window(every, 3)
            commits.clear()
            for w in range(windows):
                for every in (intervals if w % 2 == 0 else intervals[::-1]):
                    times[every].append(window(every, steps))

        measure(state)
        params = sum(p.numel() for p in model.parameters())
        results[name] = {"params": params, "batch": batch, "times": {str(k): v for k, v in times.items()},
                         "commit_s": statistics.median(commits) if commits else None}
    if world.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--models", nargs="+", default=["mlp", "resnet18"], choices=sorted(MODELS))
    p.add_argument("--intervals", type=int, nargs="+", default=[0, 1, 10],
                   help="commit every k steps (0: never, the baseline; it must be first)")
    p.add_argument("--steps", type=int, default=10, help="steps a window")
    p.add_argument("--windows", type=int, default=6, help="windows per interval")
    p.add_argument("--optimizers", nargs="+", default=["replicated"], choices=["replicated", "zero2"],
                   help="zero2: a ShardedOptimizer, committed as each rank's chunks plus a copy on its buddy rank")
    p.add_argument("--node-local", nargs="+", default=["on"], choices=["on", "off"],
                   help="on: each commit also written to the node's memory (HPCTRAIN_NODE_COMMITS, the default)")
    p.add_argument("--out", type=Path, default=REPO / "results" / "elastic_commit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--zero", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.intervals[0] != 0:
        p.error("--intervals must start with 0 (no commit: the baseline)")
    if args.worker:
        worker(args.models, args.intervals, args.steps, args.windows, args.zero)
        return
    rows = []
    for n, optimizer, node in [(n, o, d) for n in args.ranks for o in args.optimizers for d in args.node_local]:
        argv = [__file__, "--worker", "--models", *args.models, "--intervals", *map(str, args.intervals),
                "--steps", str(args.steps), "--windows", str(args.windows)] + (["--zero"] if optimizer == "zero2" else [])
        os.environ["HPCTRAIN_NODE_COMMITS"] = "1" if node == "on" else "0"
        got = launch_worker(n, argv, elastic=True)
        for name, r in got.items():
            base = r["times"]["0"]
            per_step = statistics.median(base) / args.steps
            for every in args.intervals[1:]:
                cost = statistics.median(t / b - 1 for t, b in zip(r["times"][str(every)], base))
                rows.append({"ranks": n, "model": name, "optimizer": optimizer, "node_local": node,
                             "params": r["params"], "every": every,
                             "step_s": per_step, "commit_s": r["commit_s"], "cost": cost})
    data = {"rows": rows, "cores": CORES, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                   for k, v in vars(args).items()}}
    lines = [f"Elastic commit cost: step time with state.commit() every k steps against no commit, Adam, medians of "
             f"{args.windows} alternating windows of {args.steps} steps ({CORES}-core machine).\n",
             "| ranks | model | optimizer | node-local | parameters | commit every | step (no commit) | one commit | "
             "cost (share of step time) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['ranks']}{oversubscribed(r['ranks'])} | {r['model']} | {r['optimizer']} | "
                     f"{r['node_local']} | {r['params'] / 1e6:.1f} M | "
                     f"{r['every']} | {r['step_s'] * 1e3:.0f} ms | {r['commit_s'] * 1e3:.1f} ms | "
                     f"{r['cost'] * 100:+.1f}% |")
    table = "\n".join(lines)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r['model']} ({r['optimizer']}, node-local {r['node_local']}), {r['ranks']} ranks, every "
                  f"{r['every']}" for r in rows]
        ax.barh(range(len(rows)), [r["cost"] * 100 for r in rows])
        ax.axvline(5, color="grey", linestyle="--", label="5% of step time")
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.set_xlabel("step time added by committing (%)")
        ax.legend(fontsize=8)
        return fig

    write_results(args.out, "elastic_commit", data, table, draw)


if __name__ == "__main__":
    main()
