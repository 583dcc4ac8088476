"""Pipeline parallelism: measured efficiency against the bubble, GPipe against 1F1B, memory per rank.

    python benchmarks/pipeline.py                  # 2 ranks (one per core), m = 1 2 4 8 16
    python benchmarks/pipeline.py --rounds 3 --micro-batches 1 4 16

A compute-bound MLP (``--layers`` Linear(width, width) + ReLU, batch
``--batch``; 16 x 544, batch 1024 by default: many equal layers, so the split
by parameter count also splits the compute evenly; the first stage skips its
input's gradient, one matrix product in 24) runs as a 2-stage
``hpctrain.torch.Pipeline``, and in the same launch, window by window in
alternating order, as a 1-stage pipeline with the same ``m`` micro-batches and
schedule on one rank (the reference time T1(m), the other rank idle).
Efficiency = T1(m) / (p T_pipe) of neighbouring windows, against the theory
``1 - (p-1)/(m+p-1)``: pairing the windows in time keeps the drift of a shared
machine (20% over minutes here) out of the ratio.  The reference uses the same
micro-batches because small micro-batches make each matrix product slower on
one rank too (the theory assumes they cost ``1/m`` each); the whole batch on
one rank (its own launch) is reported beside it.  A second reference, T1(m)
"beside others", runs the same one-rank job on every rank at once (no
communication): the theory assumes a stage computes as fast as a lone
process, but on a small machine the other busy cores slow it (shared caches
and memory bandwidth), which is not the schedule's doing either;
"measured/theory, loaded reference" divides that out.  Memory (measured in
the first two steps, before any reference runs): the peak bytes of the
activations autograd holds for backward on each rank (saved tensors,
parameters left out, counted by ``saved_tensors_hooks``), the growth of the
peak resident set, and the most micro-batches whose activations a stage held
at once.  The batch is large enough that a stage's forward and backward of
one micro-batch (64 rows at m = 16: about 15 ms) cost some 50 times its
messages: a message costs 0.1-0.2 ms of Python and MPI on either side here,
which at ``--batch 256`` (16-row micro-batches, about 7 ms) is 5-10% of a
step on top of the bubble; pipeline parallelism is for stages whose
micro-batch compute dwarfs a message.  Medians over ``--rounds`` launches of ``--windows`` windows; the
launches alternate order between rounds.  Writes ``pipeline.json``,
``pipeline.md`` and ``pipeline.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import launch_worker, paired_windows, write_results  # noqa: E402


def worker(schedule: str, m: int, layers: int, width: int, batch: int, steps: int, windows: int) -> None:
    import copy

    import torch
    import torch.nn.functional as F

    import hpctrain
    import hpctrain.torch as ht
    from hpctrain.parallel import ParallelLayout

    torch.set_num_threads(1)
    world = hpctrain.init()
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, 10))
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

    def trainer(run):
        opt = torch.optim.SGD(run.parameters(), lr=1e-3)

        def step():
            opt.zero_grad()
            if isinstance(run, ht.Pipeline):
                run.train_step(x, y)
            else:
                F.cross_entropy(run(x), y).backward()
            opt.step()
        return step

    if schedule == "none":                      # the whole batch at once on one rank: time and memory
        pipe, solo = trainer(model), None
    else:
        # this rank's stage of the pipeline, and (for the references) the whole model as a 1-stage
        # pipeline with the same m micro-batches and schedule on a communicator of its own
        own = world.split(world.rank)
        solo = trainer(ht.Pipeline(copy.deepcopy(model), ParallelLayout(pp=1, comm=own), micro_batches=m,
                                   schedule=schedule))
        run = ht.Pipeline(model, ParallelLayout(pp=world.size, comm=world), micro_batches=m, schedule=schedule)
        pipe = trainer(run)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = _SavedBytes(params)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        for _ in range(2):
            pipe()
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024    # KiB -> MiB
    peaks = world.allgather_object({"rss_growth_mib": grown, "activation_mib": saved.peak / 2**20,
                                    "in_flight": run.peak_in_flight if solo is not None else 1})

    def window(peer: str, n: int) -> float:
        """Seconds per step of ``peer``: the pipeline, or the one-rank reference alone or beside the others."""
        world.barrier()
        t0 = time.perf_counter()
        if peer == "pipeline":
            for _ in range(n):
                pipe()
        elif peer == "beside others" or world.rank == 0:      # "alone": rank 0 only, the others idle
            for _ in range(n):
                solo()
        took = time.perf_counter() - t0
        world.barrier()
        return took / n

    peers = ["pipeline"] if solo is None else ["pipeline", "alone", "beside others"]
    times = paired_windows(window, peers, windows, steps)
    if world.rank == 0:
        print("RESULT " + json.dumps({"step_s": times, "ranks": peaks}), flush=True)
    hpctrain.shutdown()


class _SavedBytes:
    """Peak bytes of the tensors autograd saves for backward (activations), parameters left out.

    Counted by storage, so views of one tensor count once; a storage is
    released when the last saved reference to it is freed (its graph is gone).
    """

    def __init__(self, exclude):
        self.exclude, self.refs, self.live, self.peak = exclude, {}, 0, 0

    def pack(self, t):
        key = t.untyped_storage().data_ptr()
        if key in self.exclude or t.device.type != "cpu":
            return t
        count, size = self.refs.get(key, (0, t.untyped_storage().nbytes()))
        if count == 0:
            self.live += size
            self.peak = max(self.peak, self.live)
        self.refs[key] = (count + 1, size)
        return _Saved(t, key, self)

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Saved) else h

    def release(self, key):
        count, size = self.refs[key]
        if count == 1:
            del self.refs[key]
            self.live -= size
        else:
            self.refs[key] = (count - 1, size)


class _Saved:
    __slots__ = ("t", "key", "owner")

    def __init__(self, t, key, owner):
        self.t, self.key, self.owner = t, key, owner

    def __del__(self):
        self.owner.release(self.key)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"], choices=["gpipe", "1f1b"])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=544)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="results/pipeline")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--m", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = [str(args.layers), str(args.width), str(args.batch), str(args.steps), str(args.windows)]
    if args.worker:
        worker(args.worker, args.m, *(int(v) for v in shape))
        return
    # the whole batch on one rank (for reference), then each pipeline with its one-rank references
    peers = [("none", 1, 1)] + [(s, m, args.stages) for s in args.schedules for m in args.micro_batches]
    results = {p: [] for p in peers}
    for rnd in range(args.rounds):
        for schedule, m, n in (peers if rnd % 2 == 0 else peers[::-1]):
            print(f"[round {rnd + 1}/{args.rounds}] {schedule} m={m} on {n} rank(s)", file=sys.stderr, flush=True)
            argv = [__file__, "--worker", schedule, "--m", str(m), "--layers", shape[0], "--width", shape[1],
                    "--batch", shape[2], "--steps", shape[3], "--windows", shape[4]]
            results[(schedule, m, n)].append(launch_worker(n, argv))
    t1 = statistics.median(t for r in results[peers[0]] for t in r["step_s"]["pipeline"])
    p = args.stages
    rows = []
    for schedule, m, n in peers[1:]:
        runs = results[(schedule, m, n)]

        def med(peer):
            return statistics.median(v for r in runs for v in r["step_s"][peer])

        def paired(ref):      # efficiency window by window: T1(m) / (p T) of neighbouring windows
            return statistics.median(a / (p * t) for r in runs
                                     for a, t in zip(r["step_s"][ref], r["step_s"]["pipeline"]))
        theory = 1 - (p - 1) / (m + p - 1)
        measured, loaded = paired("alone"), paired("beside others")
        rows.append({"schedule": schedule, "micro_batches": m, "step_s": med("pipeline"), "efficiency": measured,
                     "one_rank_same_micro_batches_s": med("alone"),
                     "efficiency_vs_whole_batch": t1 / (p * med("pipeline")),
                     "one_rank_beside_others_s": med("beside others"), "efficiency_vs_loaded": loaded,
                     "theory": theory, "ratio_to_theory": measured / theory,
                     "loaded_ratio_to_theory": loaded / theory,
                     "activation_mib": [statistics.median(r["ranks"][k]["activation_mib"] for r in runs)
                                        for k in range(n)],
                     "rss_growth_mib": [statistics.median(r["ranks"][k]["rss_growth_mib"] for r in runs)
                                        for k in range(n)],
                     "in_flight": [runs[0]["ranks"][k]["in_flight"] for k in range(n)]})
    single_rss = statistics.median(r["ranks"][0]["rss_growth_mib"] for r in results[peers[0]])
    write_outputs(rows, t1, single_rss, Path(args.out), args)


def write_outputs(rows, t1: float, single_rss: float, out: Path, args) -> None:
    data = {"rows": rows, "single_step_s": t1, "single_rss_growth_mib": single_rss,
            "args": vars(args)}
    lines = [f"{args.stages}-stage pipeline of {args.layers} x Linear({args.width}) + ReLU, batch {args.batch}, "
             f"one thread per rank; one rank runs the whole model in {t1 * 1e3:.1f} ms/step (peak RSS growth "
             f"{single_rss:.0f} MiB). Efficiency = T1(m) / (p T), T1(m) the same m micro-batches on one rank "
             f"in the same launch, window by window (the whole batch at once: 'vs T1'); theory = 1 - (p-1)/(m+p-1); "
             f"efficiencies are medians of the ratios of neighbouring windows, {args.rounds} rounds x "
             f"{args.windows} windows.\n",
             "| schedule | m | ms/step | T1(m) ms | efficiency | vs T1 | theory | measured/theory "
             "| T1(m) beside others ms | measured/theory, loaded reference "
             "| peak activations per rank (MiB) | RSS growth per rank (MiB) | micro-batches in flight per stage |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['micro_batches']} | {r['step_s'] * 1e3:.1f} | "
                     f"{r['one_rank_same_micro_batches_s'] * 1e3:.1f} | {r['efficiency']:.1%} | "
                     f"{r['efficiency_vs_whole_batch']:.1%} | {r['theory']:.1%} | {r['ratio_to_theory']:.2f} | "
                     f"{r['one_rank_beside_others_s'] * 1e3:.1f} | {r['loaded_ratio_to_theory']:.2f} | "
                     f"{' / '.join(f'{v:.1f}' for v in r['activation_mib'])} | "
                     f"{' / '.join(f'{v:.0f}' for v in r['rss_growth_mib'])} | "
                     f"{' / '.join(str(v) for v in r['in_flight'])} |")
    table = "\n".join(lines)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 4))
        ms = sorted({r["micro_batches"] for r in rows})
        ax.plot(ms, [1 - (args.stages - 1) / (m + args.stages - 1) for m in ms], "k--", label="theory")
        for schedule in dict.fromkeys(r["schedule"] for r in rows):
            pts = [(r["micro_batches"], r["efficiency"]) for r in rows if r["schedule"] == schedule]
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=schedule)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("pipeline efficiency")
        ax.set_ylim(0, 1.05)
        ax.legend()
        return fig

    write_results(out, "pipeline", data, table, draw, dpi=120)


if __name__ == "__main__":
    main()
