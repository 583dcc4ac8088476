"""All-reduce bandwidth: hpctrain (auto, shm, ring, native) against mpi4py, torch.distributed (gloo) and Horovod.

Each peer runs in its own mpirun launch (Horovod's background thread busy-polls
and would slow whatever shares its processes), peers alternate within each
round so machine drift hits all alike, and the reported time is the median
over rounds of each round's median.  Bus bandwidth as nccl-tests defines it:
``busbw = bytes / time * 2 (n-1) / n``.  Every result is a new array on every
peer (the input is left alone), so allocation costs are alike.  The table also
gives hpctrain auto's bandwidth over mpi4py's and Horovod's, and its time over
a single-process memcpy of the same bytes into a preallocated buffer (the
floor).  "-inplace" peers reduce a persistent buffer in place; hpctrain's
"-shared" peer reduces, in place, a buffer from ``comm.shared_empty`` (where
the PyTorch DistributedOptimizer keeps its gradient buckets); "-arena" runs
auto with ``HPCTRAIN_CROSS_MEMORY=0`` (large one-node buffers staged through
the shared arena instead of copied directly between ranks).  Writes JSON, a
markdown table and a PNG.

``--collective reduce_scatter`` or ``allgather`` times those instead, on the
hpctrain peers (``auto``, ``native``; they have no in-place form yet) and
mpi4py's (``Reduce_scatter_block`` / ``Allgather`` into a new array):
the size is the whole buffer (the reduce-scatter's input, the allgather's
output) and bus bandwidth is ``bytes / time * (n-1) / n``.  Several
collectives time one after the other in each launch (a third of the
launches of one run per collective), each written to OUT/<collective>; an
"-inplace" peer times the plain form of the collectives that have no other
(and is named so in their tables).

    python benchmarks/allreduce.py --ranks 2 4 --out results/allreduce
    python benchmarks/allreduce.py --collective reduce_scatter --peers hpctrain-auto hpctrain-native mpi4py
    python benchmarks/allreduce.py --collective allreduce reduce_scatter allgather \
        --peers hpctrain-auto-inplace hpctrain-native mpi4py-inplace --out results/collectives
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

PEERS = ("hpctrain-auto", "hpctrain-auto-inplace", "hpctrain-auto-shared", "hpctrain-auto-arena", "hpctrain-shm",
         "hpctrain-ring", "hpctrain-native", "mpi4py", "mpi4py-inplace", "torch-gloo", "horovod")
MIB = 1 << 20


def human(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


# ---------------------------------------------------------------- worker (one launch, one peer)
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
ONLY_ALLREDUCE = ("-inplace", "-shared", "-arena", "torch-gloo", "horovod")


def make_other(peer: str, collective: str):
    """Return (rank, size, barrier, op(whole buffer)) for a reduce-scatter or allgather of ``peer``."""
    if peer.startswith("hpctrain"):
        import hpctrain

        comm = hpctrain.init("mpi")
        alg = peer.split("-")[1]
        if collective == "reduce_scatter":
            return comm.rank, comm.size, comm.barrier, lambda x: comm.reduce_scatter(x, algorithm=alg)
        return comm.rank, comm.size, comm.barrier, lambda x: comm.allgather(x[: x.size // comm.size],
                                                                            algorithm=alg)
    from mpi4py import MPI

    c = MPI.COMM_WORLD

    def op(x):
        out = np.empty(x.size // c.size if collective == "reduce_scatter" else x.size // c.size * c.size,
                       dtype=x.dtype)
        if collective == "reduce_scatter":
            c.Reduce_scatter_block(x[: out.size * c.size], out, op=MPI.SUM)
        else:
            c.Allgather(x[: x.size // c.size], out)
        return out
    return c.rank, c.size, c.Barrier, op


def peer_for(peer: str, collective: str) -> str:
    """Return what ``peer`` runs for ``collective``: itself, or for a collective without an in-place form
    (reduce-scatter, allgather) the plain form of an "-inplace" peer."""
    return peer[:-len("-inplace")] if collective != "allreduce" and peer.endswith("-inplace") else peer


def make_op(peer: str, collective: str = "allreduce"):
    """Return (rank, size, barrier, op(buffer)) for ``peer``: its all-reduce, or ``collective``."""
    if collective != "allreduce":
        if peer.endswith(ONLY_ALLREDUCE) or not peer.startswith(("hpctrain", "mpi4py")):
            raise ValueError(f"{peer} times only all-reduces")
        return make_other(peer, collective)
    # "-inplace" peers reduce a persistent buffer of zeros in place (as a distributed optimizer does
    # with its gradient buckets): no result array is allocated, so no page faults per call.
    buffers = {}

    def persistent(x):
        if x.size not in buffers:
            buffers[x.size] = np.zeros_like(x)
        return buffers[x.size]

    if peer.startswith("hpctrain"):
        if peer.endswith("-arena"):   # every large one-node all-reduce staged through the shared arena
            os.environ["HPCTRAIN_CROSS_MEMORY"] = "0"
        import hpctrain

        comm = hpctrain.init("mpi")
        alg = peer.split("-")[1]
        if peer.endswith("-shared"):   # a buffer from comm.shared_empty, as DistributedOptimizer's buckets
            shared = {}

            def reduce_shared(x):
                if x.size not in shared:
                    shared[x.size] = comm.shared_empty(x.size, x.dtype)
                    shared[x.size][:] = 0
                return comm.allreduce(shared[x.size], algorithm=alg, inplace=True)
            return comm.rank, comm.size, comm.barrier, reduce_shared
        if peer.endswith("-inplace"):
            return comm.rank, comm.size, comm.barrier, lambda x: comm.allreduce(persistent(x), algorithm=alg,
                                                                                inplace=True)
        return comm.rank, comm.size, comm.barrier, lambda x: comm.allreduce(x, algorithm=alg)
    if peer.startswith("mpi4py"):
        from mpi4py import MPI

        c = MPI.COMM_WORLD

        def op(x):
            if peer.endswith("-inplace"):
                buf = persistent(x)
                c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                return buf
            out = np.empty_like(x)
            c.Allreduce(x, out, op=MPI.SUM)
            return out
        return c.rank, c.size, c.Barrier, op
    if peer == "torch-gloo":
        import torch
        import torch.distributed as dist

        rank, size = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}",
                                rank=rank, world_size=size)

        def op(x):
            t = torch.from_numpy(x.copy())
            dist.all_reduce(t)
            return t
        return rank, size, dist.barrier, op
    if peer == "horovod":
        import horovod.torch as hvd
        import torch

        hvd.init()
        return hvd.rank(), hvd.size(), hvd.barrier, lambda x: hvd.allreduce(torch.from_numpy(x), op=hvd.Sum)
    raise ValueError(peer)


def worker(peer: str, sizes, seconds: float, collectives=("allreduce",)) -> None:
    results = {}
    for collective in collectives:
        rank, size, barrier, op = make_op(peer_for(peer, collective), collective)
        results[collective] = time_sizes(op, barrier, sizes, seconds)
    if rank == 0:
        print("RESULT " + json.dumps({"peer": peer, "size": size, "times": results}), flush=True)


def time_sizes(op, barrier, sizes, seconds: float) -> dict:
    """Return the median time of ``op`` at each size (after two warm-up calls: hpctrain's first call of a
    size class measures its choice there)."""
    results = {}
    for nbytes in sizes:
        x = np.ones(nbytes // 4, dtype=np.float32)
        for _ in range(2):
            op(x)
        times = []
        # The same count on every rank (a count from a clock would differ and desynchronise them).
        iters = max(5, min(200, int(seconds * 4e8 / nbytes)))
        for _ in range(iters):
            barrier()
            t0 = time.perf_counter()
            op(x)
            times.append(time.perf_counter() - t0)
        results[nbytes] = statistics.median(times)
    return results


# ---------------------------------------------------------------- driver
def launch(peer: str, n: int, sizes, seconds: float, collectives=("allreduce",)) -> dict:
    """Return {collective: {bytes: median seconds}} of one launch of ``peer`` on ``n`` ranks."""
    res = launch_worker(n, [__file__, "--worker", peer, "--seconds", str(seconds), "--collective", *collectives,
                            "--sizes", *map(str, sizes)])
    return {c: {int(k): v for k, v in times.items()} for c, times in res["times"].items()}


def memcpy_times(sizes, seconds: float) -> dict:
    """Return the median time of a single-process memcpy of each size into a preallocated buffer."""
    out = {}
    for nbytes in sizes:
        src, dst = np.ones(nbytes // 4, dtype=np.float32), np.empty(nbytes // 4, dtype=np.float32)
        iters = max(5, min(400, int(seconds * 4e8 / nbytes)))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        out[nbytes] = statistics.median(times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="time budget per size and launch")
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds (the demo)")
    ap.add_argument("--out", default="results/allreduce")
    ap.add_argument("--collective", nargs="+", choices=COLLECTIVES, default=["allreduce"],
                    help="one or more, timed one after the other in each launch")
    ap.add_argument("--sizes", type=int, nargs="+", help="sizes in bytes (default: 4 KiB to 64 MiB by x4, 256 MiB)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.sizes, args.seconds, args.collective)
        return
    for c in args.collective:
        if c != "allreduce":
            bad = [p for p in args.peers if peer_for(p, c).endswith(ONLY_ALLREDUCE)
                   or not p.startswith(("hpctrain", "mpi4py"))]
            if bad:
                ap.error(f"--collective {c} takes hpctrain-auto/-native/-shm/-ring and mpi4py, not {bad}")
    sizes = args.sizes or [4096 << (2 * i) for i in range(8)] + [256 * MIB]
    if args.quick:
        sizes, args.rounds, args.seconds = [4096, 64 * 1024, MIB, 16 * MIB, 64 * MIB], 2, 0.5
    rows = {c: [] for c in args.collective}
    for n in args.ranks:
        runs = {p: [] for p in args.peers}
        copies = []
        for rnd in range(args.rounds):
            order = args.peers if rnd % 2 == 0 else list(reversed(args.peers))
            for peer in order:
                print(f"[{n} ranks, round {rnd + 1}/{args.rounds}] {peer}", file=sys.stderr, flush=True)
                runs[peer].append(launch(peer, n, sizes, args.seconds, args.collective))
            copies.append(memcpy_times(sizes, args.seconds))
        for c in args.collective:
            for peer in args.peers + ["memcpy"]:
                for nbytes in sizes:
                    t = statistics.median(r[nbytes] for r in (copies if peer == "memcpy"
                                                              else [run[c] for run in runs[peer]]))
                    factor = 2 if c == "allreduce" else 1
                    busbw = nbytes / t * factor * (n - 1) / n / 1e9 if n > 1 and peer != "memcpy" else 0.0
                    rows[c].append({"ranks": n, "peer": peer_for(peer, c), "bytes": nbytes, "time_s": t,
                                    "busbw_GBps": busbw})
    for c in args.collective:
        write_outputs(rows[c], Path(args.out) / c if len(args.collective) > 1 else Path(args.out), args, c)


def write_outputs(rows, out: Path, args, collective: str) -> None:
    data = {"rows": rows, "rounds": args.rounds, "collective": collective}
    peers = [p for p in dict.fromkeys(r["peer"] for r in rows) if p != "memcpy"]
    lines = []

    def ratio(a, b):
        return a / b if a and b else float("nan")

    for n in sorted({r["ranks"] for r in rows}):
        lines += [f"\n### {collective}, {n} ranks{oversubscribed(n)}: bus bandwidth GB/s "
                  f"(median of {args.rounds} rounds)\n",
                  "auto/mpi4py and auto/horovod: hpctrain auto's bus bandwidth over theirs (higher is better); "
                  "in-place: the same for the -inplace peers; time/memcpy: time over a single-process memcpy of "
                  "the same bytes (lower is better)\n",
                  "| size | " + " | ".join(peers) + " | auto/mpi4py | auto/horovod | auto time/memcpy "
                  "| in-place auto/mpi4py | in-place time/memcpy | shared-buffer time/memcpy |",
                  "|---" * (len(peers) + 7) + "|"]
        for nbytes in sorted({r["bytes"] for r in rows}):
            cell = {r["peer"]: r for r in rows if r["ranks"] == n and r["bytes"] == nbytes}
            auto, mpi, hvd = (cell.get(k, {}).get("busbw_GBps") for k in ("hpctrain-auto", "mpi4py", "horovod"))
            t_auto, t_copy, t_ip = (cell.get(k, {}).get("time_s") for k in ("hpctrain-auto", "memcpy",
                                                                              "hpctrain-auto-inplace"))
            ip, mpi_ip = (cell.get(k, {}).get("busbw_GBps") for k in ("hpctrain-auto-inplace", "mpi4py-inplace"))
            t_sh = cell.get("hpctrain-auto-shared", {}).get("time_s")
            lines.append(f"| {human(nbytes)} | " + " | ".join(f"{cell[p]['busbw_GBps']:.2f}" for p in peers)
                         + f" | {ratio(auto, mpi):.2f} | {ratio(auto, hvd):.2f} | {ratio(t_auto, t_copy):.2f}"
                         + f" | {ratio(ip, mpi_ip):.2f} | {ratio(t_ip, t_copy):.2f} | {ratio(t_sh, t_copy):.2f} |")
        lines += ["", f"latency in microseconds ({collective}, {n} ranks)\n", "| size | " + " | ".join(peers)
                  + " | auto/mpi4py time |", "|---" * (len(peers) + 2) + "|"]
        for nbytes in sorted({r["bytes"] for r in rows if r["bytes"] <= 64 * 1024}):
            cell = {r["peer"]: r for r in rows if r["ranks"] == n and r["bytes"] == nbytes}
            t_auto, t_mpi = (cell.get(k, {}).get("time_s") for k in ("hpctrain-auto", "mpi4py"))
            lines.append(f"| {human(nbytes)} | " + " | ".join(f"{cell[p]['time_s'] * 1e6:.1f}" for p in peers)
                         + f" | {ratio(t_auto, t_mpi):.2f} |")
    table = "\n".join(lines)

    def draw(plt):
        ranks = sorted({r["ranks"] for r in rows})
        fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks), 4), squeeze=False)
        for ax, n in zip(axes[0], ranks):
            for p in peers:
                pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["ranks"] == n and r["peer"] == p)
                ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=p)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.set_title(f"{collective}, {n} ranks")
            ax.legend()
        return fig

    write_results(out, collective, data, table, draw)


if __name__ == "__main__":
    main()
