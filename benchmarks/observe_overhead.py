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

``--framework keras``: the same CNN in Keras 3 ``fit`` with hpctrain's
DistributedOptimizer; ``timeline`` adds ``hk.TimelineCallback`` (a span per
batch), ``timeline split`` the same with ``split_steps=True`` (marks in the
compiled step split it into forward, backward, synchronisation and update),
``metrics`` ``hk.StepMetricsCallback``; each window is one ``fit`` whose
step is traced afresh, its first batch (the tracing) untimed.

The overhead of a mode is the median over rounds of its per-step time
divided by ``off``'s in the same round (target: <= 1.03).  Writes JSON, a
markdown table and a PNG.

    python benchmarks/observe_overhead.py --ranks 2 4 --out results/observe
    python benchmarks/observe_overhead.py --framework keras --ranks 2 4 --out results/observe-keras
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
from common import launch_worker, oversubscribed, paired_windows, write_results  # noqa: E402

MODES = ("off", "timeline", "metrics", "both")
KERAS_MODES = MODES + ("timeline split",)     # TimelineCallback(split_steps=True): marks in the compiled step


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

    alternate(comm, window, rounds, steps)


def alternate(comm, window, rounds: int, steps: int, modes=MODES) -> None:
    """Run ``window(mode, steps)`` for every mode, ``rounds`` times in alternating order; rank 0 prints RESULT."""
    import hpctrain

    out = paired_windows(window, modes, rounds, steps)
    if comm.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    hpctrain.shutdown()


def keras_worker(rounds: int, steps: int) -> None:
    """The same modes for Keras ``fit``: TimelineCallback (with its marks in the step) and StepMetricsCallback.

    Each window is one ``fit`` of ``steps + 1`` batches whose step is traced afresh (with the marks when the
    timeline callback is in); the first batch (the tracing) is not timed.
    """
    import keras
    import numpy as np

    import hpctrain
    import hpctrain.tensorflow.keras as hk

    comm = hpctrain.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)

    class Timer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1:
                self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.end = time.perf_counter()

    def window(mode: str, n: int) -> float:
        x = rng.normal(size=((n + 1) * 64, 8, 8, 1)).astype("float32")
        y = rng.integers(0, 10, (n + 1) * 64)
        tl, timer = comm.timeline, Timer()
        callbacks = [timer]
        if mode in ("timeline", "both", "timeline split"):
            tl.start()
            callbacks.append(hk.TimelineCallback(split_steps=mode == "timeline split"))
        if mode in ("metrics", "both"):
            callbacks.append(hk.StepMetricsCallback(samples_per_step=64))
        model.train_function = None                  # traced afresh: with the marks only under the callback
        comm.barrier()
        model.fit(x, y, batch_size=64, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
        tl.stop()
        tl.clear()
        return float(max(comm.allgather_object(timer.end - timer.start))) / n

    alternate(comm, window, rounds, steps, KERAS_MODES)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default="results/observe")
    ap.add_argument("--framework", choices=("torch", "keras"), default="torch")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        (keras_worker if args.framework == "keras" else worker)(args.rounds, args.steps)
        return
    data = {"rounds": args.rounds, "steps": args.steps, "runs": {}}
    lines = ["| ranks | mode | median step (ms) | overhead vs off (median of per-round ratios) | min..max ratio |",
             "|---|---|---|---|---|"]
    for n in args.ranks:
        res = launch_worker(n, [os.path.abspath(__file__), "--worker", "--framework", args.framework,
                                "--rounds", str(args.rounds), "--steps", str(args.steps)])
        modes = KERAS_MODES if args.framework == "keras" else MODES
        ratios = {m: [a / b for a, b in zip(res[m], res["off"])] for m in modes}
        data["runs"][str(n)] = {"step_s": res, "ratio_to_off": ratios}
        for m in modes:
            lines.append(f"| {n}{oversubscribed(n)} | {m} | {statistics.median(res[m]) * 1e3:.3f} | "
                         f"{statistics.median(ratios[m]):.4f} | {min(ratios[m]):.3f}..{max(ratios[m]):.3f} |")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, n in enumerate(args.ranks):
            r = data["runs"][str(n)]["ratio_to_off"]
            ax.bar([j + i * 0.35 for j in range(len(r))], [statistics.median(v) for v in r.values()], 0.35,
                   label=f"{n} ranks")
        ax.axhline(1.03, color="red", linestyle="--", linewidth=1, label="target 1.03")
        ax.set_xticks(range(len(r)), list(r))
        ax.set_ylim(0.9, 1.1)
        ax.set_ylabel("step time / step time with nothing on")
        ax.set_title(f"Cost of the timeline and the per-step metrics ({args.framework})")
        ax.legend(fontsize=8)
        return fig

    write_results(Path(args.out), "observe_overhead", data, "\n".join(lines), draw)


if __name__ == "__main__":
    main()
