"""ZeRO: hpctrain's ShardedOptimizer (stages 1 and 2) against its unsharded optimizer and torch's ZeroRedundancyOptimizer.

Same run, same model (``--layers`` x Linear(``--width``, ``--width``): 24 x 2048 is 100.7 M parameters), Adam,
``--ranks`` ranks, each peer in its own mpirun launch, peers alternating over ``--repeats`` rounds:

* ``unsharded``  ``hpctrain.torch.DistributedOptimizer`` (every rank holds all of Adam's moments);
* ``zero1``, ``zero2``  ``hpctrain.torch.ShardedOptimizer(stage=1 | 2)``; ``zero2-overlap`` with
  ``overlap_allgather=True`` (each layer waits for its parameters' allgather just before its forward);
* ``torch-zero``  DDP (gloo) with torch's ``ZeroRedundancyOptimizer`` (Adam), the peer's way of sharding.

Per peer (medians over the rounds): the step time (median of the timed steps of a launch), the optimizer-state
bytes a rank holds (the largest over ranks: the tensors in its optimizer's state) and its peak resident memory
(``ru_maxrss``, the largest over ranks; psutil's RSS after the run also recorded).  The formula: Adam's moments
are 8 bytes a parameter; sharded, 8/N (+ one bucket's rounding); stage 2 also drops the local gradients (4/N
bytes a parameter kept instead of 4).  Labelled with the machine's cores: a 2-core machine oversubscribes 4
ranks and its step times are not a node's.

    python benchmarks/zero.py --ranks 2 4 --repeats 3 --out results/zero
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CORES, launch_worker, oversubscribed, write_results  # noqa: E402

PEERS = ("unsharded", "zero1", "zero2", "zero2-overlap", "torch-zero")
BATCH = 8


def worker(args) -> None:
    import psutil
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = sum(p.numel() for p in model.parameters())
    if args.worker == "torch-zero":
        import torch.distributed as dist
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from mpi4py import MPI

        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=rank,
                                world_size=size)
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)

        def gather(x):
            out = [None] * size
            dist.all_gather_object(out, x)
            return out

        def state_bytes():
            return _bytes(opt.optim.state)
    else:
        import hpctrain
        import hpctrain.torch as ht

        comm = hpctrain.init("mpi")
        rank, size, net = comm.rank, comm.size, model
        ht.broadcast_parameters(model.state_dict(), root=0)
        adam = torch.optim.Adam(model.parameters(), lr=1e-4)
        if args.worker == "unsharded":
            opt = ht.DistributedOptimizer(adam, named_parameters=model.named_parameters())
        else:
            opt = ht.ShardedOptimizer(adam, stage=int(args.worker[4]), named_parameters=model.named_parameters(),
                                      overlap_allgather=args.worker.endswith("-overlap"))
        gather = comm.allgather_object

        def state_bytes():
            return opt.shard_bytes() if args.worker != "unsharded" else _bytes(opt.state)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, args.width, generator=g), torch.randn(BATCH, args.width, generator=g)
    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    mine = {"step_s": statistics.median(times), "state_bytes": state_bytes(),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss": psutil.Process().memory_info().rss}
    every = gather(mine)
    if rank == 0:
        result = {k: max(r[k] for r in every) for k in mine}
        result["step_s"] = statistics.median(r["step_s"] for r in every)
        result["params"] = params
        print("RESULT " + json.dumps(result), flush=True)


def _bytes(state) -> int:
    import torch

    return sum(v.numel() * v.element_size() for st in state.values() for v in st.values() if torch.is_tensor(v))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    p.add_argument("--out", default="results/zero")
    p.add_argument("--worker", choices=PEERS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    shape = ["--layers", str(args.layers), "--width", str(args.width), "--steps", str(args.steps),
             "--warmup", str(args.warmup)]
    runs = {n: {peer: [] for peer in args.peers} for n in args.ranks}
    for n in args.ranks:
        for r in range(args.repeats):
            for peer in (args.peers if r % 2 == 0 else args.peers[::-1]):
                runs[n][peer].append(launch_worker(n, [__file__, "--worker", peer, *shape], timeout=1800))
    summary = {n: {peer: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for peer, rs in by.items()}
               for n, by in runs.items()}
    write_results(Path(args.out), "zero", {"cores": CORES, "runs": runs, "summary": summary, "args": vars(args)},
                  _table(summary, args), lambda plt: _draw(plt, summary))


def _table(summary, args) -> str:
    lines = [f"ZeRO, {args.layers} x Linear({args.width}) "
             f"({next(iter(next(iter(summary.values())).values()))['params'] / 1e6:.1f} M parameters), Adam, "
             f"batch {BATCH} a rank; medians of {args.repeats} launches; {CORES}-core machine", "",
             "| ranks | peer | step s | x unsharded | x torch-zero | optimizer state MiB a rank | "
             "x unsharded | peak RSS MiB a rank | saved vs unsharded MiB | formula MiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n, by in summary.items():
        base, peer = by.get("unsharded"), by.get("torch-zero")
        for name, s in by.items():
            p = s["params"]
            formula = {"zero1": 8 * p * (1 - 1 / n), "zero2": 12 * p * (1 - 1 / n)}.get(name)   # (overlap: more in flight)
            cells = [str(n) + oversubscribed(n), name, f"{s['step_s']:.3f}",
                     f"{s['step_s'] / base['step_s']:.2f}" if base else "-",
                     f"{s['step_s'] / peer['step_s']:.2f}" if peer else "-",
                     f"{s['state_bytes'] / 2 ** 20:.1f}",
                     f"{s['state_bytes'] / base['state_bytes']:.3f}" if base else "-",
                     f"{s['peak_rss'] / 2 ** 20:.0f}",
                     f"{(base['peak_rss'] - s['peak_rss']) / 2 ** 20:.0f}" if base else "-",
                     f"{formula / 2 ** 20:.0f}" if formula else "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _draw(plt, summary):
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for n, by in summary.items():
        names = list(by)
        a.plot(names, [by[k]["step_s"] for k in names], "o-", label=f"{n} ranks")
        b.plot(names, [by[k]["peak_rss"] / 2 ** 20 for k in names], "o-", label=f"{n} ranks")
    a.set_ylabel("step time (s, median)")
    b.set_ylabel("peak resident memory a rank (MiB)")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("ZeRO: hpctrain ShardedOptimizer vs unsharded and torch ZeroRedundancyOptimizer")
    return fig


if __name__ == "__main__":
    main()
