"""Gradient compression: accuracy, bytes on the wire and time of every compressor, PyTorch and TensorFlow.

    python benchmarks/compression.py                                # both frameworks, 2 and 4 ranks
    python benchmarks/compression.py --frameworks torch --ranks 2 --methods none topk powersgd

Each run is one launch of ``examples/torch_digits.py`` or ``examples/tf_digits.py``
(the digits CNN, Adam, fixed global batch) with ``--compression SPEC``, so the
figures are what a user of the examples gets.  Repeat ``r`` uses seed ``r``
(initial weights, data split and order), the same for every method, so each
method's accuracy change is paired with the uncompressed run of the same seed:
the table gives the median over seeds of those differences (one test sample
is 0.28 points of the 360-sample test set, so one seed alone is noisy).
Every weight is compressed (``--compress-min-numel 0``: on this small CNN the default 1024-value floor
would keep a third of the bytes dense); biases stay dense except for the
casts, which take every tensor.  Per run: final test accuracy; payload bytes
this rank sent per step against fp32 (``x fewer``) and against fp16; time per
training step; compress + decompress time per step.  Methods are run in an
order that alternates between repeats; times are medians over repeats.
Training runs 30 epochs by default (the examples' own default: to convergence).  Writes
``compression.json``, ``compression.md`` and ``compression.png`` under ``--out``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import oversubscribed, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"torch": REPO / "examples" / "torch_digits.py", "tf": REPO / "examples" / "tf_digits.py"}
METHODS = {
    "none": "none", "fp16": "fp16", "bf16": "bf16", "topk": "topk:ratio=0.01", "randomk": "randomk:ratio=0.1",
    "threshold": "threshold:tau=0.001", "dgc": "dgc:ratio=0.01,warmup_steps=60", "qsgd": "qsgd:levels=64",
    "terngrad": "terngrad", "signsgd": "signsgd", "efsignsgd": "efsignsgd", "onebit": "onebit",
    "powersgd": "powersgd:rank=2,start_iter=0",
}
# the targets: method -> (minimum x fewer bytes than fp32, maximum accuracy loss in points)
TARGETS = {"topk": (40, 1.0), "powersgd": (20, 1.0), "onebit": (25, 2.0), "efsignsgd": (25, 2.0), "fp16": (2, 0.3)}


def run_example(framework: str, n: int, spec: str, epochs: int, seed: int) -> dict:
    from hpctrain.launcher.launch import build_command

    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as tmp:
        out = Path(tmp) / "summary.json"
        argv = [sys.executable, str(EXAMPLES[framework]), "--epochs", str(epochs), "--seed", str(seed),
                "--compression", spec, "--compress-min-numel", "0", "--out", str(out)]
        env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
        proc = subprocess.run(build_command(n, argv, env=env), capture_output=True, text=True, env=env,
                              timeout=1800)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{framework} {spec} at {n} ranks failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frameworks", nargs="+", choices=sorted(EXAMPLES), default=["torch", "tf"])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="seeds 0 .. repeats-1")
    ap.add_argument("--out", default="results/compression")
    args = ap.parse_args()
    methods = ["none"] + [m for m in args.methods if m != "none"]      # the reference always runs
    rows = []
    for framework in args.frameworks:
        for n in args.ranks:
            runs = {m: [] for m in methods}
            for rep in range(args.repeats):
                for m in (methods if rep % 2 == 0 else methods[::-1]):
                    print(f"[{framework}, {n} ranks, repeat {rep + 1}/{args.repeats}] {METHODS[m]}",
                          file=sys.stderr, flush=True)
                    runs[m].append(run_example(framework, n, METHODS[m], args.epochs, seed=rep))
            base = [r["test_accuracy"] for r in runs["none"]]          # by seed
            for m in methods:
                rows.append(summarize(framework, n, m, runs[m], base))
            write_outputs(rows, Path(args.out), args)      # after every group: a stopped run keeps what it has


def summarize(framework: str, n: int, method: str, runs, base_accuracy) -> dict:
    """One table row: medians over the repeats of one method; accuracy change paired by seed with ``base_accuracy``."""
    stats = [r["compression"] for r in runs]
    sent = statistics.median(s["sent_bytes_per_step"] for s in stats)
    dense = statistics.median(s["dense_bytes_per_step"] for s in stats)
    acc = statistics.median(r["test_accuracy"] for r in runs)
    row = {"framework": framework, "ranks": n, "method": method, "spec": METHODS[method],
           "accuracy": acc, "accuracy_delta_points": 100 * statistics.median(
               r["test_accuracy"] - b for r, b in zip(runs, base_accuracy)),
           "sent_bytes_per_step": sent, "received_bytes_per_step": statistics.median(
               s["received_bytes_per_step"] for s in stats),
           "fewer_than_fp32": dense / sent if sent else float("inf"),
           "vs_fp16": sent / (dense / 2) if dense else float("nan"),
           "step_ms": 1e3 * statistics.median(r["train_seconds"] / r["steps"] for r in runs),
           "codec_ms": 1e3 * statistics.median(s["compress_s_per_step"] + s["decompress_s_per_step"] for s in stats),
           "repeats": len(runs), "runs": runs}
    target = TARGETS.get(method)
    if target:
        row["target"] = f">= {target[0]}x, within {target[1]} pt"
        row["meets_target"] = row["fewer_than_fp32"] >= target[0] - 1e-9 and \
            -row["accuracy_delta_points"] <= target[1] + 1e-9
    return row


def write_outputs(rows, out: Path, args) -> None:
    data = {"rows": rows, "epochs": args.epochs,
            "repeats": args.repeats}
    lines = [f"Digits CNN (examples/), Adam, {args.epochs} epochs; medians of {args.repeats} repeats (seeds "
             f"0-{args.repeats - 1}; Δ points: median of the differences to the uncompressed run of the same seed). "
             "x fewer: fp32 bytes / payload bytes sent per rank per step; vs fp16: payload / fp16 bytes; "
             "codec: compress + decompress time per step.\n"]
    for framework in dict.fromkeys(r["framework"] for r in rows):
        for n in dict.fromkeys(r["ranks"] for r in rows if r["framework"] == framework):
            lines += [f"\n### {framework}, {n} ranks{oversubscribed(n)}\n",
                      "| method | accuracy | Δ points | x fewer than fp32 | vs fp16 | step ms | codec ms | target |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in rows:
                if r["framework"] != framework or r["ranks"] != n:
                    continue
                verdict = "" if "target" not in r else f"{r['target']}: {'met' if r['meets_target'] else 'MISSED'}"
                lines.append(f"| {r['spec']} | {r['accuracy']:.4f} | {r['accuracy_delta_points']:+.1f} | "
                             f"{r['fewer_than_fp32']:.1f} | {r['vs_fp16']:.3f} | {r['step_ms']:.2f} | "
                             f"{r['codec_ms']:.2f} | {verdict} |")
    table = "\n".join(lines)

    def draw(plt):
        groups = list(dict.fromkeys((r["framework"], r["ranks"]) for r in rows))
        fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
        for ax, (framework, n) in zip(axes[0], groups):
            for r in rows:
                if (r["framework"], r["ranks"]) == (framework, n):
                    ax.scatter(r["fewer_than_fp32"], r["accuracy"])
                    ax.annotate(r["method"], (r["fewer_than_fp32"], r["accuracy"]), fontsize=7)
            ax.set_xscale("log")
            ax.set_xlabel("x fewer bytes than fp32 (log)")
            ax.set_ylabel("test accuracy")
            ax.set_title(f"{framework}, {n} ranks")
        return fig

    write_results(out, "compression", data, table, draw, dpi=120)


if __name__ == "__main__":
    main()
