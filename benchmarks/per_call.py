"""Per-call cost: the time of one repeated small collective through hpctrain against the bare mpi4py call.

A training loop makes the same small calls again and again; there the
fixed cost of a call, not the bytes, decides.  Each case times a loop of
identical calls of one small buffer (``--bytes``, 4 KiB by default) in
one launch per rank count, all cases in the same processes, alternating
rounds; reported: the median over rounds of the per-call time, and
hpctrain's time minus mpi4py's for the same semantics (the cost hpctrain
adds).  At one rank nothing travels, so the difference is hpctrain's own
work per call: conversion, the call's key, the lane, the watchdog's record
(the call check has no peer to meet there).  Cases:

* ``allreduce-inplace``: ``comm.allreduce(x, inplace=True)`` of a numpy
  array against ``MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x)``;
* ``allreduce-inplace-native``: the same with ``algorithm="native"`` (the
  call check, then the library's call);
* ``allreduce-inplace-torch``: the same of a CPU torch tensor (against the
  same mpi4py call on its numpy view);
* ``allreduce``: out of place, against ``Allreduce(x, out)`` into a new array;
* ``reduce_scatter``, ``allgather``: against ``Reduce_scatter_block`` and
  ``Allgather`` into new arrays.

    python benchmarks/per_call.py --ranks 1 2 --out results/per_call
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import launch_worker, oversubscribed, write_results  # noqa: E402

CASES = ("allreduce-inplace", "allreduce-inplace-native", "allreduce-inplace-torch", "allreduce", "reduce_scatter", "allgather")


def worker(nbytes: int, rounds: int, seconds: float) -> None:
    import json

    import numpy as np
    import torch
    from mpi4py import MPI

    import hpctrain

    comm, mc = hpctrain.init(), MPI.COMM_WORLD
    n, count = comm.size, nbytes // 4
    x, t = np.ones(count, np.float32), torch.ones(count)
    whole = np.ones(count * n, np.float32)
    pairs = {   # case: (hpctrain's call, mpi4py's call of the same semantics)
        "allreduce-inplace": (lambda: comm.allreduce(x, inplace=True), lambda: mc.Allreduce(MPI.IN_PLACE, x)),
        "allreduce-inplace-native": (lambda: comm.allreduce(x, inplace=True, algorithm="native"),
                                     lambda: mc.Allreduce(MPI.IN_PLACE, x)),
        "allreduce-inplace-torch": (lambda: comm.allreduce(t, inplace=True),
                                    lambda: mc.Allreduce(MPI.IN_PLACE, t.numpy())),
        "allreduce": (lambda: comm.allreduce(x), lambda: mc.Allreduce(x, np.empty_like(x))),
        "reduce_scatter": (lambda: comm.reduce_scatter(whole),
                           lambda: mc.Reduce_scatter_block(whole, np.empty(count, np.float32))),
        "allgather": (lambda: comm.allgather(x), lambda: mc.Allgather(x, np.empty(count * n, np.float32))),
    }

    def timed(fn) -> float:
        """Seconds per call over about ``seconds`` of calls (the count agreed by all ranks)."""
        mc.Barrier()
        t0 = time.perf_counter()
        for _ in range(200):          # (warm-up and calibration: every rank makes the same calls)
            fn()
        calls = max(200, int(seconds / (mc.allreduce(time.perf_counter() - t0, op=MPI.MAX) / 200)))
        mc.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return mc.allreduce(time.perf_counter() - t0, op=MPI.MAX) / calls

    times = {case: {"hpctrain": [], "mpi4py": []} for case in CASES}
    for r in range(rounds):
        for case in CASES:
            order = ("hpctrain", "mpi4py") if r % 2 == 0 else ("mpi4py", "hpctrain")
            for who in order:
                times[case][who].append(timed(pairs[case][0 if who == "hpctrain" else 1]))
    if comm.rank == 0:
        print("RESULT " + json.dumps(times), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1])
    ap.add_argument("--bytes", type=int, default=4096, help="buffer size per rank (the allgather's input)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.3, help="time per case and round")
    ap.add_argument("--out", default="results/per_call")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.bytes, args.rounds, args.seconds)
    rows = []
    for n in args.ranks:
        res = launch_worker(n, [__file__, "--worker", "--bytes", str(args.bytes), "--rounds", str(args.rounds),
                                "--seconds", str(args.seconds)])
        for case in CASES:
            hp, mp = (statistics.median(res[case][w]) * 1e6 for w in ("hpctrain", "mpi4py"))
            rows.append({"ranks": n, "case": case, "hpctrain_us": hp, "mpi4py_us": mp, "added_us": hp - mp,
                         "rounds": res[case]})
    lines = [f"Per-call time of a repeated {args.bytes}-byte collective, microseconds (median of {args.rounds} "
             "rounds); added: hpctrain minus mpi4py for the same semantics.", "",
             "| ranks | case | hpctrain | mpi4py | added |", "|---|---|---|---|---|"]
    lines += [f"| {r['ranks']}{oversubscribed(r['ranks'])} | {r['case']} | {r['hpctrain_us']:.2f} | "
              f"{r['mpi4py_us']:.2f} | {r['added_us']:.2f} |" for r in rows]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['case']}\n{r['ranks']} rank(s)" for r in rows]
        pos = range(len(rows))
        ax.bar([p - 0.2 for p in pos], [r["hpctrain_us"] for r in rows], 0.4, label="hpctrain")
        ax.bar([p + 0.2 for p in pos], [r["mpi4py_us"] for r in rows], 0.4, label="mpi4py")
        ax.set_xticks(list(pos), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("us per call")
        ax.set_yscale("log")
        ax.legend()
        return fig
    write_results(Path(args.out), "per_call", {"bytes": args.bytes, "rows": rows}, "\n".join(lines), draw)


if __name__ == "__main__":
    main()
