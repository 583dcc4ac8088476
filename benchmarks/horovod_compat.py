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
from common import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "horovod" / "pytorch_synthetic_benchmark.py"
PEERS = ("horovod", "hpctrain.horovod", "hpctrain", "none", "horovod-default-malloc")


def launch(peer: str, n: int, batch: int, image: int, iters: int) -> float:
    """Run the script once for ``peer``; return total img/s."""
    from hpctrain.launch import build_command
    from hpctrain.memory import USER_SETTINGS, environment

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        api = peer.split("-")[0]
        argv = [sys.executable, str(SCRIPT), "--api", api, "--batch-size", str(batch), "--image-size", str(image),
                "--num-warmup-batches", "5", "--num-batches-per-iter", "3", "--num-iters", str(iters),
                "--json", out]
        env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
        env.update(OMP_NUM_THREADS="1", **({} if peer == "horovod-default-malloc" else environment()))
        proc = subprocess.run(build_command(n, argv, env=env), capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{peer} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["total_img_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--image-sizes", type=int, nargs="+", default=[64, 224])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5,
                    help="timed iterations (of 3 steps, after 5 warm-up steps) per launch")
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--out", default=str(ROOT / "results" / "horovod-compat"))
    args = ap.parse_args()
    rows = []
    for batch in args.batch_sizes:
        for image in args.image_sizes:
            runs = {p: [] for p in args.peers}
            for r in range(args.rounds):
                for peer in (args.peers if r % 2 == 0 else args.peers[::-1]):
                    runs[peer].append(launch(peer, args.ranks, batch, image, args.iters))
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
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    write_outputs(rows, Path(args.out), args)


def write_outputs(rows, out: Path, args) -> None:
    lines = [f"ResNet-18, synthetic images, {args.ranks} ranks, median img/s (all ranks) over {args.rounds} "
             f"alternating rounds; comm share = 1 - img/s / img/s of `none`", "",
             "| batch | image | " + " | ".join(f"{p} img/s" for p in args.peers)
             + " | hpctrain.horovod / best horovod | hpctrain.horovod / hpctrain | comm share best horovod | "
             "comm share hpctrain.horovod |", "|" + "---|" * (len(args.peers) + 6)]
    for r in rows:
        share = r.get("comm_share", {})
        cells = [f"{r['img_per_s'][p]:.1f}" for p in args.peers]
        lines.append(f"| {r['batch']} | {r['image']} | " + " | ".join(cells)
                     + f" | {r.get('vs_horovod', float('nan')):.2f} | {r.get('vs_native', float('nan')):.3f} | "
                     f"{share.get('horovod_best', float('nan')):.0%} | "
                     f"{share.get('hpctrain.horovod', float('nan')):.0%} |")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"b{r['batch']}/{r['image']}px" for r in rows]
        width = 0.8 / len(args.peers)
        for i, p in enumerate(args.peers):
            ax.bar([x + i * width for x in range(len(rows))], [r["img_per_s"][p] for r in rows], width, label=p)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels)
        ax.set_ylabel("img/s, all ranks")
        ax.set_title(f"Horovod-style ResNet-18 training, {args.ranks} ranks")
        ax.legend()
        return fig

    write_results(out, "horovod_compat", {"rows": rows, "args": vars(args)}, "\n".join(lines), draw)


if __name__ == "__main__":
    main()
