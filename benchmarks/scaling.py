"""Weak scaling of data-parallel training: hpctrain against torch DDP (gloo) and Horovod, or against Keras' own.

``--framework torch`` (default) trains PyTorch models; ``--framework tf``
trains Keras 3 models against plain ``model.fit`` and
``tf.distribute.MultiWorkerMirroredStrategy`` (see benchmarks/scaling_tf.py);
the harness, the efficiency formula and the outputs are the same.

Every rank trains the same model on its own fixed-size batch of synthetic data
(weak scaling), one thread per rank.  Peers, each in its own mpirun launch:

* ``torch``    plain single-process training loop (1 rank only: the baseline);
* ``hpctrain`` ``hpctrain.torch.DistributedOptimizer`` (MPI backend);
* ``ddp``      ``torch.nn.parallel.DistributedDataParallel`` over gloo;
* ``horovod``  ``horovod.torch.DistributedOptimizer`` (Horovod's MPI controller);
* ``independent`` every rank trains alone, no communication at all: the
  ceiling this machine allows (cores, memory bandwidth, clocks shared by the
  ranks), against which the peers' efficiencies should be read.

Throughput is samples per second over all ranks; efficiency =
throughput(N) / (N x throughput(1) of the same peer).  Each launch times
several windows of steps after a warm-up; the reported figure is the median
over windows and rounds, peers alternating order per round.

hpctrain's overhead at one rank is measured apart, in one process, because
launches differ by several percent on a shared machine: two identical models,
one trained by a plain loop and one through ``DistributedOptimizer``, alternate
window by window; the figure is the median of the per-pair throughput ratios.

    python benchmarks/scaling.py --ranks 1 2 4 --out results/scaling
    python benchmarks/scaling.py --framework tf --ranks 1 2 4 --out results/scaling-tf

A peer whose launch fails (other than hpctrain) is reported as failed, with
its error in the JSON, instead of ending the sweep.
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
import scaling_tf  # noqa: E402
from common import CORES, launch_worker, oversubscribed, paired_windows, write_results  # noqa: E402

PEERS = ("torch", "independent", "hpctrain", "ddp", "horovod")
MODELS = {"resnet18": 32, "mlp": 128}   # model -> per-rank batch
DIGITS_BATCH = 24                        # examples/torch_digits.py's per-rank batch at 2 ranks
# framework -> (peers, models, the one-process baseline peer)
FRAMEWORKS = {"torch": (PEERS, MODELS, "torch"), "tf": (scaling_tf.PEERS, scaling_tf.MODELS, "keras")}


# ---------------------------------------------------------------- models
def build(model: str):
    """Return (module, input shape, number of classes)."""
    import torch.nn as nn

    if model == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                             nn.Linear(2048, 10)), (1024,), 10
    if model == "digits":             # examples/torch_digits.py's CNN (38 k parameters, 8x8 images)
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
                             nn.Linear(64, 10)), (1, 8, 8), 10
    return _resnet18(num_classes=100), (3, 64, 64), 100


def _resnet18(num_classes: int):
    """ResNet-18 (He et al. 2016), the torch.nn one of examples/horovod/resnets.py."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "horovod"))
    import resnets

    return resnets.resnet18(num_classes=num_classes)


# ---------------------------------------------------------------- worker (one launch, one peer)
def worker(peer: str, model_names, batches, steps: int, windows: int) -> None:
    """Train each of ``model_names`` in turn as ``peer`` on this launch's ranks (one process-group setup for
    all); rank 0 prints RESULT {"throughput": {model: [samples/s of each window]}}."""
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    if peer == "hpctrain":
        import hpctrain
        import hpctrain.torch as ht

        hpctrain.init("mpi")
    elif peer == "ddp":
        import torch.distributed as dist

        master = os.environ.get("BENCH_MASTER", "127.0.0.1")       # (rank 0's address: node1's across nodes)
        dist.init_process_group("gloo", init_method=f"tcp://{master}:{os.environ['BENCH_PORT']}",
                                rank=rank, world_size=size)
    elif peer == "horovod":
        import horovod.torch as hvd

        hvd.init()
    elif peer == "torch" and size != 1:
        raise SystemExit("the plain torch loop runs on one rank only")
    results = {}
    for model_name, batch in zip(model_names, batches):
        torch.manual_seed(0)
        model, shape, classes = build(model_name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if peer == "hpctrain":
            optimizer = ht.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            ht.broadcast_parameters(model.state_dict())
        elif peer == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        elif peer == "horovod":
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(batch, *shape, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)

        def step():
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

        for _ in range(3):   # warm-up: allocator, buckets, Horovod's response cache
            step()
        times = []
        for _ in range(windows):
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            world.Barrier()
            times.append(time.perf_counter() - t0)
        results[model_name] = [size * batch * steps / t for t in times]
    if rank == 0:
        print("RESULT " + json.dumps({"throughput": results}), flush=True)


def overhead_worker(model_name: str, batch: int, steps: int, windows: int) -> None:
    """One rank: alternate timed windows of a plain loop and of DistributedOptimizer; print both."""
    import torch
    import torch.nn.functional as F

    import hpctrain
    import hpctrain.torch as ht

    torch.set_num_threads(1)
    hpctrain.init("mpi")
    runs = {}
    for peer in ("torch", "hpctrain"):
        torch.manual_seed(0)
        model, shape, classes = build(model_name)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        if peer == "hpctrain":
            opt = ht.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        x, y = torch.randn(batch, *shape), torch.randint(0, classes, (batch,))
        runs[peer] = (model, opt, x, y)

    def window(peer: str, n: int) -> float:
        model, opt, x, y = runs[peer]
        t0 = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return batch * n / (time.perf_counter() - t0)

    print("RESULT " + json.dumps(paired_windows(window, ["torch", "hpctrain"], windows, steps)), flush=True)


# ---------------------------------------------------------------- driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=sorted(FRAMEWORKS), default="torch")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--models", nargs="+", help="default: all of the framework's (torch: resnet18 mlp; tf: cnn mlp)")
    ap.add_argument("--peers", nargs="+", help="default: all of the framework's")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--windows", type=int, default=3, help="timed windows per launch")
    ap.add_argument("--steps", type=int, default=6, help="steps per timed window")
    ap.add_argument("--out", default="results/scaling")
    ap.add_argument("--overhead-windows", type=int, default=12,
                    help="paired windows for the 1-rank overhead (0 skips it)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    all_peers, models, baseline = FRAMEWORKS[args.framework]
    mod = scaling_tf if args.framework == "tf" else sys.modules[__name__]
    if args.worker == "overhead":
        mod.overhead_worker(args.model, models[args.model], args.steps, args.windows)
        return
    if args.worker:
        if args.framework == "torch":     # several models, one after the other in one launch
            names = args.model.split(",")
            mod.worker(args.worker, names, [DIGITS_BATCH if m == "digits" else models[m] for m in names],
                       args.steps, args.windows)
        else:
            mod.worker(args.worker, args.model, models[args.model], args.steps, args.windows)
        return
    args.models, args.peers = args.models or list(models), args.peers or list(all_peers)
    for what, given, known in (("model", args.models, models), ("peer", args.peers, all_peers)):
        if set(given) - set(known):
            ap.error(f"unknown {what}(s) for --framework {args.framework}: {sorted(set(given) - set(known))}; "
                     f"choose from {list(known)}")
    if 1 not in args.ranks:
        ap.error("--ranks must include 1 (efficiency is relative to one rank)")
    rows, failures = [], {}
    # torch: every model in one launch per (ranks, round, peer); Keras: a launch per model
    groups = [args.models] if args.framework == "torch" else [[m] for m in args.models]
    samples = {}
    for group in groups:
        for n in sorted(args.ranks):
            peers = [p for p in args.peers if p != baseline or n == 1]
            for rnd in range(args.rounds):
                for peer in (peers if rnd % 2 == 0 else peers[::-1]):
                    if any((m, peer) in failures for m in group):
                        continue
                    print(f"[{', '.join(group)}, {n} ranks, round {rnd + 1}/{args.rounds}] {peer}", file=sys.stderr,
                          flush=True)
                    try:
                        res = launch_worker(n, [__file__, "--framework", args.framework, "--worker", peer, "--model",
                                                ",".join(group), "--steps", str(args.steps), "--windows",
                                                str(args.windows)])
                    except RuntimeError as exc:
                        if peer == "hpctrain":
                            raise
                        failures.update({(m, peer): str(exc) for m in group})
                        print(f"  {peer} failed; reported as failed:\n{str(exc)[-600:]}", file=sys.stderr)
                        continue
                    got = res["throughput"]
                    for m in group:
                        samples.setdefault((m, n, peer), []).extend(got[m] if isinstance(got, dict) else got)
    for model in args.models:
        for n in sorted(args.ranks):
            for peer in [p for p in args.peers if p != baseline or n == 1]:
                if samples.get((model, n, peer)):
                    rows.append({"model": model, "ranks": n, "peer": peer, "batch_per_rank": models[model],
                                 "throughput": statistics.median(samples[(model, n, peer)]),
                                 "samples": samples[(model, n, peer)]})
    overhead = {}
    for model in args.models:
        if args.overhead_windows and "hpctrain" in args.peers:
            print(f"[{model}, 1 rank] plain loop vs hpctrain, paired windows", file=sys.stderr, flush=True)
            res = launch_worker(1, [__file__, "--framework", args.framework, "--worker", "overhead", "--model", model,
                                    "--steps", str(args.steps), "--windows", str(args.overhead_windows)])
            ratios = [h / t for h, t in zip(res["hpctrain"], res[baseline])]
            overhead[model] = {"ratio": statistics.median(ratios), "ratios": ratios, **res}
    for row in rows:
        one = next((r for r in rows if r["model"] == row["model"] and r["ranks"] == 1 and r["peer"] == row["peer"]),
                   None)
        row["efficiency"] = row["throughput"] / (row["ranks"] * one["throughput"]) if one else float("nan")
    write_outputs(rows, overhead, failures, Path(args.out), args)


def write_outputs(rows, overhead, failures, out: Path, args) -> None:
    all_peers, models, baseline = FRAMEWORKS[args.framework]
    meta = {"framework": args.framework, "cores": CORES, "rounds": args.rounds, "windows": args.windows,
            "steps": args.steps, "threads_per_rank": 1}
    data = {"rows": rows, "overhead_1rank": overhead, **meta,
            "failed": {f"{m} {p}": e for (m, p), e in failures.items()}}
    peers = [p for p in all_peers if p in args.peers]
    lines = [f"Weak scaling ({args.framework}), one thread per rank, {CORES} cores; samples/s (efficiency = "
             f"thr(N) / (N thr(1)) of the same peer); median of {args.rounds} rounds x {args.windows} windows x "
             f"{args.steps} steps.\n"]
    for model in dict.fromkeys(r["model"] for r in rows):
        extra = ""
        if model in overhead:
            o = overhead[model]
            extra = (f"; hpctrain at 1 rank = {o['ratio']:.3f} x the plain loop (median of {len(o['ratios'])} "
                     f"paired windows in one process)")
        lines += [f"\n### {model} (batch {models[model]} per rank){extra}\n",
                  "| ranks | " + " | ".join(peers) + " |", "|---" * (len(peers) + 1) + "|"]
        for n in sorted(set(args.ranks)):
            cells = []
            for p in peers:
                r = next((r for r in rows if r["model"] == model and r["ranks"] == n and r["peer"] == p), None)
                cells.append(f"{r['throughput']:.1f} ({r['efficiency']:.0%})" if r else
                             "failed" if (model, p) in failures else "")
            lines.append(f"| {n}{oversubscribed(n)} | " + " | ".join(cells) + " |")
    for (model, peer), err in failures.items():
        said = ([ln for ln in err.splitlines() if "Error of " in ln]
                or [ln for ln in err.splitlines() if "Error" in ln] or [ln for ln in err.splitlines() if ln.strip()])
        lines.append(f"\n{peer} failed on {model}: {(said or ['?'])[-1].strip()[:300]}")
    table = "\n".join(lines)

    def draw(plt):
        models = list(dict.fromkeys(r["model"] for r in rows))
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, model in zip(axes[0], models):
            for p in peers:
                pts = sorted((r["ranks"], r["efficiency"]) for r in rows if r["model"] == model and r["peer"] == p)
                ax.plot([n for n, _ in pts], [e for _, e in pts], marker="o", label=p)
            ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
            ax.set_xlabel(f"ranks ({CORES} cores; more are oversubscribed)")
            ax.set_ylabel("weak-scaling efficiency")
            ax.set_ylim(0, 1.1)
            ax.set_title(model)
            ax.legend()
        return fig

    write_results(out, "scaling", data, table, draw)


if __name__ == "__main__":
    main()
