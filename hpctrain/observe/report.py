"""``hpctrain report RUN_DIR``: PNG plots and a markdown summary of a run folder written by StepMetrics."""
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


def _plot(path: str, title: str, ylabel: str, series, xlabel: str = "step") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for x, y, label in series:
        ax.plot(x, y, label=label, linewidth=1.2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
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
        _plot(path, *args, **kw)
        written.append(path)

    plot("step_time.png", "Step time", "seconds", [(x, _col(steps, "step_s"), "median over ranks"),
                                                   (x, _col(steps, "step_s_max"), "slowest rank")])
    plot("throughput.png", "Throughput of the job", "samples / s", [(x, _col(steps, "samples_per_s"), "samples/s")])
    share = _col(steps, "comm_s") / np.maximum(_col(steps, "step_s"), 1e-12)
    plot("communication.png", "Communication share of the step", "fraction of the step",
         [(x, _col(steps, "exposed_comm_fraction"), "exposed (rank blocked on it)"),
          (x, share, "collectives running (overlapped or not)")])
    by_rank: Dict[int, List[Dict]] = {}
    for row in ranks:
        by_rank.setdefault(int(row["rank"]), []).append(row)
    ordered = sorted(by_rank.items())
    plot("rank_spread.png", "Own work per step of each rank (busy = step - exposed communication)", "seconds",
         [(_col(rows, "step_last"), _col(rows, "busy_s_mean"), f"rank {r}") for r, rows in ordered])
    plot("resources.png", "CPU use of each rank", "% of one core",
         [(_col(rows, "step_last"), _col(rows, "cpu_percent"), f"rank {r}") for r, rows in ordered])
    plot("memory.png", "Resident memory of each rank", "MiB",
         [(_col(rows, "step_last"), _col(rows, "rss_bytes") / 2**20, f"rank {r}") for r, rows in ordered])
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
