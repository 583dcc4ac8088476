"""What watching a run costs: training steps with the timeline and the per-step metrics off and on.

In one launch per rank count, a small CNN (the digits example's, batch 64 per
rank) trains with hpctrain's DistributedOptimizer and ``trace_forward``; in
every round each mode runs a window of steps, the modes' order alternating
between rounds:

* ``off``: nothing recorded (what every run pays: one attribute test per
  collective and per span site);
* ``timeline``: ``comm.timeline`` on (collectives and their phases, forward,
  backward, synchronize, step);
* ``metrics``: :class:`hpctrain.observe.StepMetrics` marking every step
  (communication log on, the window all-gather every 10 steps, psutil
  samples; its creation and close, once per run, are not timed);
* ``both``.

The overhead of a mode is the median over rounds of its per-step time
divided by ``off``'s in the same round (target: <= 1.03).  Writes JSON, a
markdown table and a PNG.

    python benchmarks/observe_overhead.py --ranks 2 4 --out results/observe
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
from common import launch_worker, oversubscribed, write_results  # noqa: E402

MODES = ("off", "timeline", "metrics", "both")


def worker(rounds: int, steps: int) -> None:
    import torch

    import hpctrain
    import hpctrain.torch as ht
    from hpctrain.observe import StepMetrics

    comm = hpctrain.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64),
        torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    ht.trace_forward(model)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))

    def window(mode: str, n: int) -> float:
        tl = comm.timeline
        if mode in ("timeline", "both"):
            tl.start()
        metrics = StepMetrics(comm, samples_per_step=64) if mode in ("metrics", "both") else None
        comm.barrier()
        start = time.perf_counter()
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if metrics is not None:
                metrics.mark()
        elapsed = time.perf_counter() - start      # (once-per-run costs, StepMetrics' start and close, left out)
        if metrics is not None:
            metrics.close()
        tl.stop()
        tl.clear()
        # the slowest rank's time is the step time of the job
        return float(max(comm.allgather_object(elapsed))) / n

    for mode in MODES:
        window(mode, 5)
    out = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            out[mode].append(window(mode, steps))
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hpctrain.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="results/observe")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.rounds, args.steps)
        return
    data = {"rounds": args.rounds, "steps": args.steps, "runs": {}}
    lines = ["| ranks | mode | median step (ms) | overhead vs off (median of per-round ratios) | min..max ratio |",
             "|---|---|---|---|---|"]
    for n in args.ranks:
        res = launch_worker(n, [os.path.abspath(__file__), "--worker", "--rounds", str(args.rounds),
                                "--steps", str(args.steps)])
        ratios = {m: [a / b for a, b in zip(res[m], res["off"])] for m in MODES}
        data["runs"][str(n)] = {"step_s": res, "ratio_to_off": ratios}
        for m in MODES:
            lines.append(f"| {n}{oversubscribed(n)} | {m} | {statistics.median(res[m]) * 1e3:.3f} | "
                         f"{statistics.median(ratios[m]):.4f} | {min(ratios[m]):.3f}..{max(ratios[m]):.3f} |")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, n in enumerate(args.ranks):
            r = data["runs"][str(n)]["ratio_to_off"]
            ax.bar([j + i * 0.35 for j in range(len(MODES))], [statistics.median(r[m]) for m in MODES], 0.35,
                   label=f"{n} ranks")
        ax.axhline(1.03, color="red", linestyle="--", linewidth=1, label="target 1.03")
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_ylim(0.9, 1.1)
        ax.set_ylabel("step time / step time with nothing on")
        ax.set_title("Cost of the timeline and the per-step metrics")
        ax.legend(fontsize=8)
        return fig

    write_results(Path(args.out), "observe_overhead", data, "\n".join(lines), draw)


if __name__ == "__main__":
    main()
