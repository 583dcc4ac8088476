"""Horovod's own API on hpctrain against the real Horovod 0.28.1: the same training script, the same run.

One Horovod-style synthetic training script (examples/horovod/pytorch_synthetic_benchmark.py:
ResNet-18 in torch.nn, random images, SGD) runs at 2 ranks through

* ``horovod``           the real Horovod 0.28.1 (``import horovod.torch as hvd``, its MPI controller);
* ``hpctrain.horovod``  the same script with the one import changed (Horovod's API on hpctrain);
* ``hpctrain``          hpctrain's native torch API (``hpctrain.torch.DistributedOptimizer``);
* ``none``              every rank trains alone: the compute-only step on the same loaded machine,
* ``horovod-default-malloc``  the real Horovod with glibc's allocator as it comes (below),

for every batch size and image size given.  Peers alternate their order
every round; each launch reports img/s over all ranks (mean of its timed
iterations) and the figure is the median over rounds.  Communication share
of a peer's step = 1 - throughput(peer) / throughput(none): the part of the
step the peer spends beyond computing.  Headline ratios: hpctrain.horovod /
horovod (same semantics, both averaging float32 gradients during backward;
Horovod's faster allocator mode counts) and hpctrain.horovod / hpctrain (the
cost of Horovod's API on hpctrain).

The cost of Horovod's API on hpctrain is also measured inside one launch per
batch and image size (``--paired-rounds``, the headline for it), where the
two differ in nothing but the API: copies of the model, one with hpctrain's
DistributedOptimizer, one with hpctrain.horovod's (its negotiation thread
started for its windows and stopped after them), train in alternating
windows of ``--paired-steps`` steps; the figure is the median over rounds of
native step time / hpctrain.horovod step time (the slowest rank's).  A third
copy, native too, is the control: its ratio to the first shows what two
copies of one model differ by (where their memory lies).  Separate launches
differ by a few percent each (where the processes land, their memory),
which hides a 2% difference.

``--launcher horovodrun`` starts every launch with ``horovodrun --gloo``:
Horovod runs on its Gloo controller, hpctrain on its Horovod backend (the
real Horovod's ops).  The one-launch comparison then pits hpctrain.horovod
against the real Horovod's own DistributedOptimizer in the same processes
(the control: a second copy with the real one), which is possible there
because both run on the same Horovod.

Allocator: ``hpctrain.init`` sets glibc's malloc so that memory freed in one
step is reused by the next without page faults (:mod:`hpctrain.memory`).  So
that this compares communication and not allocators, every peer runs with
the same settings as environment variables (``hpctrain.memory.environment``),
the compute-only ``none`` included; Horovod runs a second time without them
(``horovod-default-malloc``), and its faster mode is the reference.

    python benchmarks/horovod_compat.py --out results/horovod-compat
    python benchmarks/horovod_compat.py --batch-sizes 4 --image-sizes 64 --rounds 3 --out /tmp/hc
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import paired_windows, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"
PEERS = ("horovod", "hpctrain.horovod", "hpctrain", "none", "horovod-default-malloc")


def launch(peer: str, n: int, batch: int, image: int, iters: int, gloo: bool = False) -> float:
    """Run the script once for ``peer`` (under ``horovodrun --gloo`` with ``gloo``); return total img/s."""
    from hpctrain.launcher.launch import build_command
    from hpctrain.memory import USER_SETTINGS, environment

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        api = peer.split("-")[0]
        argv = [sys.executable, str(SCRIPT), "--api", api, "--batch-size", str(batch), "--image-size", str(image),
                "--num-warmup-batches", "5", "--num-batches-per-iter", "3", "--num-iters", str(iters),
                "--json", out]
        env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
        env.update(OMP_NUM_THREADS="1", **({} if peer == "horovod-default-malloc" else environment()))
        proc = subprocess.run(build_command(n, argv, env=env, gloo=gloo), capture_output=True, text=True, env=env,
                              timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{peer} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["total_img_per_s"]


def paired_worker(batch: int, image: int, rounds: int, steps: int, reference: str) -> None:
    """In one launch: ``reference`` (hpctrain or, under horovodrun, horovod) vs hpctrain.horovod windows,
    alternating, with a second copy of the reference as the control; rank 0 prints RESULT {...}."""
    import copy
    import time

    import torch
    import torch.nn.functional as F

    import hpctrain
    import hpctrain.horovod.torch as hvd
    import hpctrain.torch as ht

    sys.path.insert(0, str(SCRIPT.parent))
    import resnets

    comm = hpctrain.init()
    torch.manual_seed(0)
    control = f"{reference}, second copy"
    models = {reference: resnets.resnet18()}
    models["hpctrain.horovod"] = copy.deepcopy(models[reference])
    models[control] = copy.deepcopy(models[reference])
    if reference == "horovod":                 # the real Horovod that carries hpctrain's world here
        import horovod.torch as real
        opts = {api: real.DistributedOptimizer(torch.optim.SGD(models[api].parameters(), lr=0.01),
                                               named_parameters=models[api].named_parameters())
                for api in (reference, control)}
    else:
        opts = {api: ht.DistributedOptimizer(torch.optim.SGD(models[api].parameters(), lr=0.01),
                                             named_parameters=models[api].named_parameters())
                for api in (reference, control)}
    hvd.init()
    opts["hpctrain.horovod"] = hvd.DistributedOptimizer(torch.optim.SGD(models["hpctrain.horovod"].parameters(),
                                                                        lr=0.01),
                                                        named_parameters=models["hpctrain.horovod"].named_parameters())
    hvd.shutdown()
    data, target = torch.randn(batch, 3, image, image), torch.randint(0, 1000, (batch,))

    def window(api: str, n: int) -> float:
        model, opt = models[api], opts[api]
        if api == "hpctrain.horovod":
            hvd.init()
            hvd.allreduce(torch.zeros(1), name="window.start")     # every rank starts together
        else:
            comm.barrier()
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            F.cross_entropy(model(data), target).backward()
            opt.step()
        elapsed = time.perf_counter() - start
        if api == "hpctrain.horovod":
            hvd.shutdown()
        return max(comm.allgather_object(elapsed)) / n

    out = paired_windows(window, [reference, "hpctrain.horovod", control], rounds, steps)
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hpctrain.shutdown()


def paired(args, batch: int, image: int) -> dict:
    """Launch :func:`paired_worker`; return its step times and the per-round ratios."""
    from common import launch_worker

    reference = "horovod" if args.launcher == "horovodrun" else "hpctrain"
    res = launch_worker(args.ranks, [__file__, "--paired-worker", str(batch), str(image), str(args.paired_rounds),
                                     str(args.paired_steps), reference], gloo=args.launcher == "horovodrun")
    ratios = [a / b for a, b in zip(res[reference], res["hpctrain.horovod"])]
    control = [a / b for a, b in zip(res[reference], res[f"{reference}, second copy"])]
    return {"reference": reference, "step_s": res, "ratios": ratios, "median": statistics.median(ratios),
            "control_ratios": control, "control_median": statistics.median(control)}


def main() -> None:
    if len(sys.argv) == 7 and sys.argv[1] == "--paired-worker":
        paired_worker(*(int(a) for a in sys.argv[2:6]), sys.argv[6])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--launcher", choices=("mpirun", "horovodrun"), default="mpirun",
                    help="mpirun (Horovod on its MPI controller, hpctrain on MPI) or horovodrun --gloo (both on "
                         "Horovod's Gloo; hpctrain.horovod's gradients then go to Horovod by name)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--image-sizes", type=int, nargs="+", default=[64, 224])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5,
                    help="timed iterations (of 3 steps, after 5 warm-up steps) per launch")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--paired-rounds", type=int, default=21,
                    help="rounds of the one-launch native vs hpctrain.horovod comparison (0: skip it)")
    ap.add_argument("--paired-steps", type=int, default=10, help="steps per window of that comparison")
    ap.add_argument("--out", default=str(ROOT / "results" / "horovod-compat"))
    args = ap.parse_args()
    if args.rounds == 0:            # only the one-launch comparison
        args.peers = []
    rows = []
    for batch in args.batch_sizes:
        for image in args.image_sizes:
            runs = {p: [] for p in args.peers}
            for r in range(args.rounds):
                for peer in (args.peers if r % 2 == 0 else args.peers[::-1]):
                    runs[peer].append(launch(peer, args.ranks, batch, image, args.iters, args.launcher == "horovodrun"))
            med = {p: statistics.median(v) for p, v in runs.items()}
            row = {"batch": batch, "image": image, "ranks": args.ranks, "img_per_s": med, "runs": runs}
            horovod = [med[p] for p in ("horovod", "horovod-default-malloc") if p in med]
            if horovod:
                row["horovod_best"] = max(horovod)
            if "none" in med:
                shares = dict(med, **({"horovod_best": row["horovod_best"]} if horovod else {}))
                row["comm_share"] = {p: max(0.0, 1 - v / med["none"]) for p, v in shares.items() if p != "none"}
            if horovod and "hpctrain.horovod" in med:
                row["vs_horovod"] = med["hpctrain.horovod"] / row["horovod_best"]
            if "hpctrain" in med and "hpctrain.horovod" in med:
                row["vs_native"] = med["hpctrain.horovod"] / med["hpctrain"]
            if args.paired_rounds:
                row["paired"] = paired(args, batch, image)
                key = "vs_horovod_paired" if row["paired"]["reference"] == "horovod" else "vs_native_paired"
                row[key] = row["paired"]["median"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    write_outputs(rows, Path(args.out), args)


def paired_cell(row) -> str:
    """The one-launch ratio of a row: median (min..max over rounds), or n/a."""
    if "paired" not in row:
        return "n/a"
    ratios = row["paired"]["ratios"]
    return (f"{row['paired']['median']:.3f} ({min(ratios):.3f}..{max(ratios):.3f}); control "
            f"{row['paired']['control_median']:.3f}")


def write_outputs(rows, out: Path, args) -> None:
    reference = "horovod" if args.launcher == "horovodrun" else "hpctrain"
    head = ["batch", "image"] + [f"{p} img/s" for p in args.peers] + [
        "hpctrain.horovod / best horovod", "hpctrain.horovod / hpctrain",
        f"hpctrain.horovod / {reference}, one launch (min..max); {reference} / {reference} control",
        "comm share best horovod",
        "comm share hpctrain.horovod"]
    lines = [f"ResNet-18, synthetic images, {args.ranks} ranks ({args.launcher}), median img/s (all ranks) over {args.rounds} "
             f"alternating rounds of launches; comm share = 1 - img/s / img/s of `none`; one launch: median over "
             f"{args.paired_rounds} rounds of {args.paired_steps}-step windows, alternating in one launch", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        share = r.get("comm_share", {})
        cells = [str(r["batch"]), str(r["image"])] + [f"{r['img_per_s'][p]:.1f}" for p in args.peers] + [
            f"{r.get('vs_horovod', float('nan')):.2f}", f"{r.get('vs_native', float('nan')):.3f}", paired_cell(r),
            f"{share.get('horovod_best', float('nan')):.0%}", f"{share.get('hpctrain.horovod', float('nan')):.0%}"]
        lines.append("| " + " | ".join(cells) + " |")

    def draw(plt):
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
        labels = [f"b{r['batch']}/{r['image']}px" for r in rows]
        width = 0.8 / max(len(args.peers), 1)
        for i, p in enumerate(args.peers):
            ax.bar([x + i * width for x in range(len(rows))], [r["img_per_s"][p] for r in rows], width, label=p)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels)
        ax.set_ylabel("img/s, all ranks")
        ax.set_title(f"Horovod-style ResNet-18 training, {args.ranks} ranks, {args.launcher}", fontsize=10)
        if args.peers:
            ax.legend(fontsize=8)
        done = [r for r in rows if "paired" in r]
        med = [r["paired"]["median"] for r in done]
        low = [m - min(r["paired"]["ratios"]) for m, r in zip(med, done)]
        high = [max(r["paired"]["ratios"]) - m for m, r in zip(med, done)]
        bx.errorbar(range(len(done)), med, yerr=[low, high], fmt="o", capsize=4)
        bx.axhline(1.0, color="grey", linewidth=1)
        bx.axhline(0.98, color="red", linestyle="--", linewidth=1, label="0.98 (2% slower)")
        bx.set_xticks(range(len(done)), [f"b{r['batch']}/{r['image']}px" for r in done])
        bx.set_ylabel(f"img/s hpctrain.horovod / {reference}")
        bx.set_title(f"hpctrain.horovod against {reference}, one launch ({args.launcher})", fontsize=10)
        bx.legend(fontsize=8)
        return fig

    write_results(out, "horovod_compat", {"rows": rows, "args": vars(args)}, "\n".join(lines), draw)


if __name__ == "__main__":
    main()
