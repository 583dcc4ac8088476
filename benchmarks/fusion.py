"""Tensor fusion: ResNet-50's gradient list all-reduced fused, as one flat buffer, and one tensor at a time.

ResNet-50 has 161 parameter tensors holding 25,557,032 float32 values (the
shapes are built below from the architecture and checked against those two
numbers).  In one launch per rank count, alternating the variants within each
round, this measures

* ``grouped``: ``hpctrain.grouped_allreduce(list)`` (fusion buffers),
* ``flat``: one ``hpctrain.allreduce`` of a buffer of the same bytes,
* ``per-tensor``: one ``hpctrain.allreduce`` per tensor,
* ``mpi4py-flat`` and ``mpi4py-per-tensor``: the same with ``MPI.Allreduce``,

and reports medians and the ratios grouped/flat (target <= 1.2) and
per-tensor/grouped (target >= 5).  Writes JSON, a markdown table and a PNG.

    python benchmarks/fusion.py --ranks 2 4 --out results/fusion
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import launch_worker, oversubscribed, write_results  # noqa: E402

VARIANTS = ("grouped", "flat", "per-tensor", "mpi4py-flat", "mpi4py-per-tensor")


def resnet50_shapes():
    """Return the parameter shapes of torchvision's ResNet-50 in registration order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]                      # conv1, bn1
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:                                          # downsample conv + bn
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]                           # fc
    assert len(shapes) == 161 and sum(int(np.prod(s)) for s in shapes) == 25_557_032
    return shapes


def worker(rounds: int, repeats: int) -> None:
    import hpctrain
    from mpi4py import MPI

    comm = hpctrain.init("mpi")
    c = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in resnet50_shapes()]
    flat = np.concatenate([g.reshape(-1) for g in grads])

    def mpi_allreduce(x):
        out = np.empty_like(x)
        c.Allreduce(x, out, op=MPI.SUM)
        return out

    ops = {
        "grouped": lambda: comm.grouped_allreduce(grads),
        "flat": lambda: comm.allreduce(flat),
        "per-tensor": lambda: [comm.allreduce(g) for g in grads],
        "mpi4py-flat": lambda: mpi_allreduce(flat),
        "mpi4py-per-tensor": lambda: [mpi_allreduce(g) for g in grads],
    }
    got = comm.grouped_allreduce(grads)
    one = comm.allreduce(flat)
    assert np.array_equal(np.concatenate([g.reshape(-1) for g in got]), one), "fused and flat results differ"
    times = {v: [] for v in VARIANTS}
    for rnd in range(rounds):
        order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))
        for v in order:
            ops[v]()                                            # warm-up (allocations, arena growth)
            samples = []
            for _ in range(repeats):
                comm.barrier()
                t0 = time.perf_counter()
                ops[v]()
                samples.append(time.perf_counter() - t0)
            times[v].append(statistics.median(samples))
    if comm.rank == 0:
        print("RESULT " + json.dumps({"size": comm.size, "times": times}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per variant and round")
    ap.add_argument("--out", default="results/fusion")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.rounds, args.repeats)
        return
    rows = []
    for n in args.ranks:
        print(f"[{n} ranks] {args.rounds} rounds", file=sys.stderr, flush=True)
        res = launch_worker(n, [__file__, "--worker", "--rounds", str(args.rounds), "--repeats", str(args.repeats)])
        med = {v: statistics.median(ts) for v, ts in res["times"].items()}
        rows.append({"ranks": n, "times_s": med, "rounds": res["times"],
                     "grouped_over_flat": med["grouped"] / med["flat"],
                     "per_tensor_over_grouped": med["per-tensor"] / med["grouped"]})
    write_outputs(rows, Path(args.out), args)


def write_outputs(rows, out: Path, args) -> None:
    data = {"rows": rows, "rounds": args.rounds, "repeats": args.repeats,
             "tensors": 161, "values": 25_557_032}
    lines = [f"ResNet-50 gradients (161 float32 tensors, 102 MB): time in ms, median of {args.rounds} rounds\n",
             "| ranks | " + " | ".join(VARIANTS) + " | grouped/flat | per-tensor/grouped |",
             "|---" * (len(VARIANTS) + 3) + "|"]
    for r in rows:
        lines.append(f"| {r['ranks']}{oversubscribed(r['ranks'])} | "
                     + " | ".join(f"{r['times_s'][v] * 1e3:.1f}" for v in VARIANTS)
                     + f" | {r['grouped_over_flat']:.2f} | {r['per_tensor_over_grouped']:.1f} |")
    table = "\n".join(lines)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(VARIANTS)
        for i, v in enumerate(VARIANTS):
            ax.bar([k + i * width for k in range(len(rows))], [r["times_s"][v] * 1e3 for r in rows], width, label=v)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rows))], [f"{r['ranks']} ranks" for r in rows])
        ax.set_ylabel("time (ms)")
        ax.set_yscale("log")
        ax.set_title("all-reduce of ResNet-50's 161 gradients")
        ax.legend(fontsize=8)
        return fig

    write_results(out, "fusion", data, table, draw)


if __name__ == "__main__":
    main()
