"""A healthy job under a slow link and a long compute step: does a heartbeat declare live ranks dead?

Two namespace nodes of scripts/cluster.sh (needs root) x 2 ranks run an elastic job
(benchmarks/heartbeat_worker.py: one all-reduce of ``--mib`` MiB a step) for ``--seconds``.  At step 20 rank 3
computes for 60 s in pure Python, and from ``--shape-at`` seconds every link is shaped to ``--slow`` (tc tbf)
for ``--shape-s`` seconds, then set back to 1 Gbit/s.  Nothing fails, so any re-forming is a false alarm.
Peers, one after the other on the same nodes:

* ``hpctrain``: hpctrain's heartbeat (datagrams between the nodes' first ranks, off MPI's connections;
  HPCTRAIN_ELASTIC_SILENT_S = ``--silent-s``, 8 s by default);
* ``ompi-detector``: Open MPI's own heartbeat detector (``mpi_ft_detector``, beats every quarter of the same
  timeout on MPI's TCP connections), hpctrain's off.

    python benchmarks/heartbeat.py --out results/heartbeat
    python benchmarks/heartbeat.py --seconds 120 --shape-at 30 --shape-s 40 --out /tmp/hb   # a short look

Writes heartbeat.json, heartbeat.md (per peer: steps, re-formings, how the job ended, the longest gap between
steps) and heartbeat.png (steps over time, the slow window shaded).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CORES, write_results  # noqa: E402
from multinode import Nodes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKER = REPO / "benchmarks" / "heartbeat_worker.py"


def one_run(peer: str, args, nodes: Nodes) -> dict:
    """Run the job once for ``peer``, shaping the links on schedule; its steps' times and re-formings."""
    env = dict(nodes.env, PYTHONUNBUFFERED="1", HPCTRAIN_STALL_TIMEOUT_S=str(args.seconds + 300))
    if peer == "hpctrain":
        env["HPCTRAIN_ELASTIC_SILENT_S"] = f"{args.silent_s:g}"
    else:
        env.update(HPCTRAIN_ELASTIC_SILENT_S="0", OMPI_MCA_mpi_ft_detector="true", OMPI_MCA_mpi_ft_detector_thread="true",
                   OMPI_MCA_mpi_ft_detector_period=f"{args.silent_s / 4:g}",
                   OMPI_MCA_mpi_ft_detector_timeout=f"{args.silent_s:g}")
    argv = [BIN / "hpctrain", "launch", "--elastic", "-n", "4", "-H", "node1:2,node2:2", WORKER,
            "--seconds", args.seconds, "--mib", args.mib, "--busy-s", args.busy_s]
    start = time.monotonic()
    job = subprocess.Popen(nodes.on("node1", argv), cwd=nodes.shared, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def shape():
        time.sleep(args.shape_at)
        nodes.reshape(args.slow)
        time.sleep(args.shape_s)
        nodes.reshape("1gbit")

    shaper = threading.Thread(target=shape, daemon=True)
    shaper.start()
    steps, reformed, said = [], [], []
    timer = threading.Timer(args.seconds + args.shape_s + 300, job.kill)
    timer.start()
    try:
        for line in job.stdout:
            t = time.monotonic() - start
            m = re.fullmatch(r"step (\d+) [\d.]+\n", line)
            if m:
                steps.append((int(m.group(1)), round(t, 2)))
            elif "re-formed" in line or "hpctrain" in line:
                said.append(line.rstrip()[:300])
                if "the world re-formed" in line:
                    reformed.append(round(t, 2))
        job.wait()
    finally:
        timer.cancel()
        shaper.join()
        nodes.reshape("1gbit")
    gaps = [b[1] - a[1] for a, b in zip(steps, steps[1:])]
    return {"peer": peer, "status": job.returncode, "steps": steps, "reformed_at": reformed,
            "longest_gap_s": round(max(gaps), 2) if gaps else None, "said": said[-20:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", nargs="+", default=["hpctrain", "ompi-detector"], choices=["hpctrain", "ompi-detector"])
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--mib", type=float, default=1.0)
    p.add_argument("--busy-s", type=float, default=60.0)
    p.add_argument("--silent-s", type=float, default=8.0)
    p.add_argument("--slow", default="1mbit")
    p.add_argument("--shape-at", type=float, default=120.0)
    p.add_argument("--shape-s", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=Path("results/heartbeat"))
    args = p.parse_args()
    nodes = Nodes(2, "1gbit")
    try:
        runs = [one_run(peer, args, nodes) for peer in args.peers]
    finally:
        nodes.down()
    rows = ["| peer | steps | re-formings (false alarms) | exit status | longest gap between steps |",
            "|---|---|---|---|---|"]
    for r in runs:
        rows.append(f"| {r['peer']} | {r['steps'][-1][0] if r['steps'] else 0} | {len(r['reformed_at'])} | "
                    f"{r['status']} | {r['longest_gap_s']} s |")
    table = (f"A healthy elastic job of 2 namespace nodes x 2 ranks for {args.seconds:g} s, one all-reduce of "
             f"{args.mib:g} MiB a step; rank 3 computes {args.busy_s:g} s at step 20; every link at {args.slow} "
             f"from {args.shape_at:g} s for {args.shape_s:g} s; heartbeat timeout {args.silent_s:g} s "
             f"({CORES}-core machine)\n\n" + "\n".join(rows))

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in runs:
            if r["steps"]:
                ax.plot([t for _, t in r["steps"]], [s for s, _ in r["steps"]], label=r["peer"])
            for t in r["reformed_at"]:
                ax.axvline(t, color="red", lw=0.8)
        ax.axvspan(args.shape_at, args.shape_at + args.shape_s, color="grey", alpha=0.2, label=f"links at {args.slow}")
        ax.set_xlabel("seconds since launch")
        ax.set_ylabel("step")
        ax.set_title("healthy job: steps over time (red: a re-forming, i.e. a false alarm)")
        ax.legend()
        return fig

    write_results(args.out, "heartbeat", {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs},
                  table, draw)


if __name__ == "__main__":
    main()
