"""``hpctrain report RUN_DIR``: PNG plots and a markdown summary of a run folder written by StepMetrics.

What the plots show and leave out: the first step of a run (or of a resumed
run) is its warm-up (allocations, first-call set-up; often tens of times a
step) and is left out of the step-time and throughput lines, its time said in
the title, so it does not flatten them; the steps that end a metrics window
(where the ranks all-gather their rows) are marked by dotted lines, so a
window's own cost is not read as the job's; every axis starts at zero; and
per-rank samples (taken at most once a second) are drawn as points, so a short
run's few samples are visible.
"""
from __future__ import annotations

import csv
import json
import os
from typing import Dict, List, Optional

import numpy as np

__all__ = ["read_run", "write_report"]


def _jsonl(path: str) -> List[Dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_run(run_dir: str) -> Dict[str, List[Dict]]:
    """Return the rows of a run folder: ``steps`` (from steps.csv), ``ranks`` and ``stragglers``."""
    path = os.path.join(run_dir, "steps.csv")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} has no steps.csv: is it a run folder of hpctrain.observe.StepMetrics "
                                f"(log_dir=...)?")
    with open(path, newline="") as f:
        steps = [{k: float(v) if v not in ("", None) else float("nan") for k, v in row.items()}
                 for row in csv.DictReader(f)]
    return {"steps": steps, "ranks": _jsonl(os.path.join(run_dir, "ranks.jsonl")),
            "stragglers": _jsonl(os.path.join(run_dir, "stragglers.jsonl"))}


def _col(rows: List[Dict], key: str) -> np.ndarray:
    return np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)


def _plot(path: str, title: str, ylabel: str, series, xlabel: str = "step", windows=(), points: bool = False,
          top: Optional[float] = None, last: Optional[float] = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for x, y, label in series:
        ax.plot(x, y, "o-" if points else "-", label=label, linewidth=1.2, markersize=3)
    for i, w in enumerate(windows):
        ax.axvline(w, color="grey", linestyle=":", linewidth=0.8,
                   label="end of a metrics window (ranks all-gather their rows)" if i == 0 else None)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0, top=top)
    if last is not None:
        ax.set_xlim(0, last * 1.02)
    ax.grid(alpha=0.3)
    if len(series) > 1 or len(windows):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(run_dir: str, out_dir: Optional[str] = None) -> List[str]:
    """Draw step time, throughput, communication share, per-rank spread and resource use; write summary.md.

    Returns the files written (to ``out_dir``, default ``run_dir``).
    """
    run = read_run(run_dir)
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    steps, ranks = run["steps"], run["ranks"]
    if not steps:
        raise ValueError(f"{run_dir}/steps.csv has no steps yet")
    x = _col(steps, "step")
    written = []

    def plot(name, *args, **kw):
        path = os.path.join(out_dir, name)
        _plot(path, *args, last=float(x[-1]), **kw)
        written.append(path)

    by_rank: Dict[int, List[Dict]] = {}
    for row in ranks:
        by_rank.setdefault(int(row["rank"]), []).append(row)
    ordered = sorted(by_rank.items())
    windows = sorted({int(r["step_last"]) for r in ranks})[:-1]     # (the last one is the run's end)
    later = slice(1, None) if len(steps) > 1 else slice(None)         # the first step is the warm-up
    first = (f"; step {int(x[0])}, the warm-up, left out ({steps[0]['step_s_max']:.3g} s)"
             if len(steps) > 1 else "")
    plot("step_time.png", f"Step time{first}", "seconds",
         [(x[later], _col(steps, "step_s")[later], "median over ranks"),
          (x[later], _col(steps, "step_s_max")[later], "slowest rank")], windows=windows)
    plot("throughput.png", f"Throughput of the job{first}", "samples / s",
         [(x[later], _col(steps, "samples_per_s")[later], "samples/s")], windows=windows)
    share = _col(steps, "comm_s") / np.maximum(_col(steps, "step_s"), 1e-12)
    plot("communication.png", "Communication share of the step", "fraction of the step",
         [(x, _col(steps, "exposed_comm_fraction"), "exposed (rank blocked on it)"),
          (x, share, "collectives running (overlapped or not)")], windows=windows, top=1.05)
    plot("rank_spread.png", "Own work per step of each rank (busy = step - exposed communication)", "seconds",
         [(_col(rows, "step_last"), _col(rows, "busy_s_mean"), f"rank {r}") for r, rows in ordered], points=True)
    plot("resources.png", "CPU use of each rank (sampled at most once a second)", "% of one core",
         [(_col(rows, "step_last"), _col(rows, "cpu_percent"), f"rank {r}") for r, rows in ordered], points=True)
    plot("memory.png", "Resident memory of each rank (sampled at most once a second)", "MiB",
         [(_col(rows, "step_last"), _col(rows, "rss_bytes") / 2**20, f"rank {r}") for r, rows in ordered],
         points=True)
    path = os.path.join(out_dir, "summary.md")
    with open(path, "w") as f:
        f.write(_summary(run, ordered))
    written.append(path)
    return written


def _summary(run: Dict, ordered) -> str:
    steps = run["steps"]
    step_max = _col(steps, "step_s_max")
    samples = _col(steps, "samples")
    lines = ["# Run summary", "",
             "| steps | mean step (s) | median step (s) | samples/s | exposed communication | median busy spread |",
             "|---|---|---|---|---|---|",
             f"| {len(steps)} | {np.nanmean(step_max):.4f} | {np.nanmedian(_col(steps, 'step_s')):.4f} | "
             f"{np.nansum(samples) / np.nansum(step_max):.1f} | {np.nanmean(_col(steps, 'exposed_comm_fraction')):.1%} | "
             f"{np.nanmedian(_col(steps, 'busy_spread')):.2f} |", "",
             "## Ranks", "", "| rank | mean busy (s) | exposed communication | CPU % | RSS (MiB) | net sent (MB/s) |",
             "|---|---|---|---|---|---|"]
    for r, rows in ordered:
        lines.append(f"| {r} | {np.nanmean(_col(rows, 'busy_s_mean')):.4f} | "
                     f"{np.nanmean(_col(rows, 'exposed_comm_fraction')):.1%} | {np.nanmean(_col(rows, 'cpu_percent')):.0f} | "
                     f"{np.nanmax(_col(rows, 'rss_bytes')) / 2**20:.0f} | "
                     f"{np.nanmean(_col(rows, 'net_sent_bytes_per_s')) / 1e6:.2f} |")
    lines += ["", "## Stragglers", ""]
    lines += [f"- rank {e['rank']}: {e['ratio']:.1f}x the median busy time, steps {e['step_first']}-{e['step_last']}"
              for e in run["stragglers"]] or ["none"]
    return "\n".join(lines) + "\n"
