"""Fit the alpha-beta all-reduce model to benchmarks/multinode.py's runs, check its predictions, project to 1024 nodes.

The model is :mod:`hpctrain.collectives.cost_model` (the same code ``auto``
uses): ring, hierarchical and tree times as ``a alpha + b beta + c gamma``.
For each link rate the three constants are fitted by non-negative least
squares on relative error (each measurement weighted by ``1/t``) over
hpctrain's ring and hierarchical runs on 2 and 3 nodes.  The check: every
measured time of at least ``--min-bytes`` against its prediction, from the
fit on all runs and, held out, from a fit on the 2-node runs only (so the
3-node predictions are of runs the fit never saw).

The projection: scaling efficiency ``T_compute / (T_compute + T_allreduce)``
(no overlap of communication with computation: a lower bound) of one
data-parallel step of ResNet-50 (25,557,032 float32 gradients) and of a
1B-parameter model (float32 gradients) on 8 to 1024 nodes of ``--per-node``
ranks, for links of 10, 100 and 400 Gbit/s.  alpha and gamma are the fitted
values at the fastest measured rate; beta is ``8 / (rate * efficiency)`` with
the link efficiency (nominal over fitted beta) of the slowest measured rate,
where the processors are not the limit.  The compute time per step is an
input (``--compute``), not a measurement.  Each point takes the fastest of
the three algorithms, and the plot marks which.  Writes ``model.json``,
``model.md`` and ``model.png`` under ``--out``.

    python benchmarks/model.py --runs results/multinode/multinode.json --out results/model
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402

from hpctrain.collectives.cost_model import ALGORITHMS, LinkModel, predict, terms  # noqa: E402

MEASURED = {"hpctrain-ring": "ring", "hpctrain-hierarchical": "hierarchical"}
MODELS = {"ResNet-50": 25_557_032 * 4, "1B parameters": 1_000_000_000 * 4}
NODES = [8, 16, 32, 64, 128, 256, 512, 1024]
MIB = 1 << 20
LINKS_GBIT = [10, 100, 400]


def samples(runs: dict, rate: str, min_bytes: int, nodes=None):
    """(algorithm, nodes, bytes, seconds) of hpctrain's ring and hierarchical runs at ``rate``."""
    entry, out = runs["rates"][rate], []
    for n, peers in entry["runs"].items():
        if nodes is not None and int(n) not in nodes:
            continue
        for peer, alg in MEASURED.items():
            for size, t in peers.get(peer, {}).items():
                if int(size) >= min_bytes:
                    out.append((alg, int(n), int(size), t))
    return out


def fit(points, per_node: int) -> LinkModel:
    """alpha, beta, gamma >= 0 minimising the squared relative errors of the model on ``points``."""
    a = np.array([terms(alg, s, n, per_node) for alg, n, s, _ in points], dtype=np.float64)
    t = np.array([p[3] for p in points])
    scale = a.max(axis=0)                   # columns of one order of magnitude, for the solver
    x, _ = nnls(a / t[:, None] / scale, np.ones(len(t)))
    alpha, beta, gamma = x / scale
    return LinkModel(alpha=alpha, beta=beta, gamma=gamma)


def check(runs: dict, per_node: int, min_bytes: int) -> dict:
    """Fits per rate (all runs, and 2 nodes only) and every measurement with both predictions."""
    out = {}
    for rate in runs["rates"]:
        every = samples(runs, rate, min_bytes)
        both, two = fit(every, per_node), fit(samples(runs, rate, min_bytes, nodes=[2]), per_node)
        rows = [{"algorithm": alg, "nodes": n, "bytes": s, "measured_s": t,
                 "predicted_s": predict(both, alg, s, n, per_node),
                 "held_out_s": predict(two, alg, s, n, per_node)} for alg, n, s, t in every]
        out[rate] = {"gbit": runs["rates"][rate]["gbit"], "fit": vars(both), "fit_2_nodes": vars(two), "rows": rows}
    return out


def project(fits: dict, per_node: int, compute: dict) -> list:
    rates = sorted(fits, key=lambda r: fits[r]["gbit"])
    slow, fast = fits[rates[0]], fits[rates[-1]]
    efficiency = 8 / (slow["gbit"] * 1e9) / slow["fit"]["beta"]
    out = []
    for gbit in LINKS_GBIT:
        model = LinkModel(alpha=fast["fit"]["alpha"], beta=8 / (gbit * 1e9 * efficiency), gamma=fast["fit"]["gamma"])
        for name, nbytes in MODELS.items():
            for n in NODES:
                times = {alg: predict(model, alg, nbytes, n, per_node) for alg in ALGORITHMS}
                best = min(times, key=times.get)
                out.append({"model": name, "link_gbit": gbit, "nodes": n, "times_s": times, "best": best,
                            "efficiency": compute[name] / (compute[name] + times[best]),
                            "link_efficiency": efficiency})
    return out


def error(row, key):
    return row[key] / row["measured_s"] - 1


def write_outputs(fits: dict, projection: list, args) -> None:
    lines = []
    for rate, f in fits.items():
        rows = f["rows"]
        worst = max(abs(error(r, "predicted_s")) for r in rows)
        large = max((abs(error(r, "predicted_s")) for r in rows if r["bytes"] >= MIB), default=float("nan"))
        held = [abs(error(r, "held_out_s")) for r in rows if r["nodes"] == 3] or [float("nan")]
        lines += [f"\n### links {rate}: alpha {f['fit']['alpha'] * 1e6:.1f} us, link "
                  f"{8 / f['fit']['beta'] / 1e9:.3f} Gbit/s, memory {1 / max(f['fit']['gamma'], 1e-30) / 1e9:.2f} "
                  f"GB/s (fit on 2 nodes only: alpha {f['fit_2_nodes']['alpha'] * 1e6:.1f} us, link "
                  f"{8 / f['fit_2_nodes']['beta'] / 1e9:.3f} Gbit/s)\n",
                  f"largest error of the fit on all runs: {worst:.0%} ({large:.0%} from 1 MiB on); of the "
                  "2-node fit on the 3-node runs "
                  f"(held out): {max(held):.0%} (median {statistics.median(held):.0%})\n",
                  "| algorithm | nodes | size | measured ms | predicted ms | error | held-out ms | error |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["algorithm"], r["nodes"], r["bytes"])):
            lines.append(f"| {r['algorithm']} | {r['nodes']} | {r['bytes'] // 1024} KiB | "
                         f"{r['measured_s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} | "
                         f"{error(r, 'predicted_s'):+.0%} | "
                         f"{r['held_out_s'] * 1e3:.2f} | {error(r, 'held_out_s'):+.0%} |")
    lines += [f"\n### Projected scaling efficiency ({args.per_node} ranks per node, compute per step: "
              + ", ".join(f"{k} {v} s" for k, v in args.compute.items())
              + "; link efficiency "
              + f"{projection[0]['link_efficiency']:.0%}; best algorithm in brackets)\n",
              "| model | link | " + " | ".join(f"{n} nodes" for n in NODES) + " |", "|---" * (len(NODES) + 2) + "|"]
    for name in MODELS:
        for gbit in LINKS_GBIT:
            pts = [p for p in projection if p["model"] == name and p["link_gbit"] == gbit]
            lines.append(f"| {name} | {gbit} Gbit/s | " + " | ".join(f"{p['efficiency']:.0%} ({p['best'][:4]})"
                                                                 for p in pts) + " |")
    table = "\n".join(lines)

    def draw(plt):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        ax = axes[0]
        for rate, f in fits.items():
            for alg in MEASURED.values():
                rs = [r for r in f["rows"] if r["algorithm"] == alg]
                ax.scatter([r["measured_s"] for r in rs], [r["predicted_s"] for r in rs], label=f"{alg}, {rate}",
                           s=14)
        lo = min(r["measured_s"] for f in fits.values() for r in f["rows"])
        hi = max(r["measured_s"] for f in fits.values() for r in f["rows"])
        ax.plot([lo, hi], [lo, hi], color="grey")
        ax.plot([lo, hi], [lo * 1.2, hi * 1.2], color="grey", linestyle=":")
        ax.plot([lo, hi], [lo * 0.8, hi * 0.8], color="grey", linestyle=":")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured (s)")
        ax.set_ylabel("predicted (s)")
        ax.set_title("all-reduce on 2 and 3 nodes: model against measurement (dotted: 20%)")
        ax.legend(fontsize=7)
        ax = axes[1]
        for name, style in zip(MODELS, ("-", "--")):
            for gbit in LINKS_GBIT:
                pts = [p for p in projection if p["model"] == name and p["link_gbit"] == gbit]
                ax.plot([p["nodes"] for p in pts], [p["efficiency"] for p in pts], style, marker="o",
                        label=f"{name}, {gbit} Gbit/s")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("nodes")
        ax.set_ylabel("scaling efficiency")
        ax.set_title("projected data-parallel scaling efficiency")
        ax.legend(fontsize=7)
        return fig

    write_results(Path(args.out), "model", {"fits": fits, "projection": projection,
                                            "compute_s": args.compute, "per_node": args.per_node}, table, draw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="results/multinode/multinode.json")
    ap.add_argument("--min-bytes", type=int, default=64 * 1024, help="smallest measurement the check includes")
    ap.add_argument("--per-node", type=int, default=None, help="ranks per node of the projection (default: measured)")
    ap.add_argument("--compute", type=lambda s: dict((k, float(v)) for k, v in (kv.split("=") for kv in s.split(","))),
                    default={"ResNet-50": 0.1, "1B parameters": 1.0},
                    help="compute seconds per step, e.g. 'ResNet-50=0.1,1B parameters=1.0'")
    ap.add_argument("--out", default="results/model")
    args = ap.parse_args()
    runs = json.loads(Path(args.runs).read_text())
    args.per_node = args.per_node or runs["per_node"]
    fits = check(runs, runs["per_node"], args.min_bytes)
    write_outputs(fits, project(fits, args.per_node, args.compute), args)


if __name__ == "__main__":
    main()
