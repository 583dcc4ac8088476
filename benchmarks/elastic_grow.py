"""Taking a returning host back: hpctrain's elastic launcher against Horovod 0.28.1's elastic mode.

The same script for both (benchmarks/elastic_horovod_worker.py: examples/elastic_train.py's model, one import
apart), started on ``--ranks`` slots of one "host" (``localhost``) with a host-discovery script; once rank 0
has printed step ``--grow-step`` the driver makes the script also offer ``127.0.0.1`` with as many slots (the
same machine under a second name, as Horovod's own elastic tests do), and measures:

* ``grown``: the script's change -> the first step completed by the larger world (the first ``step`` line
  after the reset callback's ``resumed at step``);
* ``lost steps``: the last step printed before the growth minus the step the larger world resumed from.

Peers: ``hpctrain``, examples/elastic_train.py itself (the same model and training; ``hpctrain.elastic.run``
with ``HPCTRAIN_ELASTIC_GROW=spawn``: the world grows in place, new ranks spawned on the added host and merged in at a commit, the running ones
waiting meanwhile); ``hpctrain.horovod`` under ``hpctrain launch --elastic --host-discovery-script`` (Horovod's
API: the ranks write the commit, the job restarts on both hosts and loads it: a process start and the imports,
for every rank);
``horovod``: ``horovodrun --host-discovery-script`` (Gloo; the running workers stay, new ones start on the
added host and everyone meets at a new rendezvous).  Medians over ``--repeats``, the peers alternating.

    python benchmarks/elastic_grow.py --ranks 2 --repeats 3 --out results/elastic_grow
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CORES, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
WORKER = str(REPO / "benchmarks" / "elastic_horovod_worker.py")
EXAMPLE = str(REPO / "examples" / "elastic_train.py")


def command(peer: str, args, script: Path) -> list:
    training = ["--samples", str(args.samples), "--epochs", "1", "--batch", str(args.batch),
                "--commit-every", str(args.commit_every), "--step-sleep", str(args.step_sleep)]
    n, most = str(args.ranks), str(2 * args.ranks)
    if peer == "hpctrain":      # (hpctrain.elastic's own API, the same model: the world grows in place)
        return [str(BIN / "hpctrain"), "launch", "--elastic", "--min-np", n, "--max-np", most,
                "--host-discovery-script", str(script), EXAMPLE, *training, "--log-steps"]
    if peer == "horovod":
        return [str(BIN / "horovodrun"), "-np", n, "--min-np", n, "--max-np", most, "--network-interface", "lo",
                "--host-discovery-script",
                str(script), sys.executable, WORKER, "--api", "horovod", *training]
    return [str(BIN / "hpctrain"), "launch", "--elastic", "--min-np", n, "--max-np", most, "--host-discovery-script",
            str(script), WORKER, "--api", "hpctrain.horovod", *training]


def one_run(peer: str, args) -> dict:
    """Start on one host, add the second at the grow step, and time the growth."""
    with tempfile.TemporaryDirectory(prefix=f"grow-{peer}-", dir=REPO / "results") as tmp:
        work = Path(tmp)
        flag, script = work / "grow", work / "discover.sh"
        script.write_text(f"#!/bin/sh\necho localhost:{args.ranks}\n"
                          f"[ -f {flag} ] && echo 127.0.0.1:{args.ranks}\nexit 0\n")
        script.chmod(0o755)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HPCTRAIN_STALL_TIMEOUT_S="120",
                   HPCTRAIN_ELASTIC_GROW="spawn")        # (the hpctrain peer: in place; the others restart)
        proc = subprocess.Popen(command(peer, args, script), cwd=work, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        added_at = grown_at = before = resumed = None
        log = []
        try:
            for line in proc.stdout:
                log.append(line)
                text = line.strip()
                m = re.search(r"\bstep (\d+)$", text)
                if m and added_at is None and int(m.group(1)) >= args.grow_step:
                    flag.touch()
                    added_at = time.time()
                if added_at is not None and resumed is None:
                    if m:
                        before = int(m.group(1))
                    r = re.search(r"resumed at step (\d+)", text)
                    if r:
                        resumed = int(r.group(1))
                elif m and resumed is not None and grown_at is None:
                    grown_at = time.time()
            proc.wait(timeout=args.timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text = "".join(log)
        sizes = re.findall(r"finished: \d+ steps, world of (\d+)", text)
        if grown_at is None or not sizes:
            raise RuntimeError(f"{peer}: exit status {proc.returncode}, no growth seen:\n{text[-3000:]}")
        return {"peer": peer, "grown_s": grown_at - added_at, "lost_steps": before - resumed, "before": before,
                "resumed": resumed, "new_size": int(sizes[-1])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="ranks on the first host (as many join on the second)")
    p.add_argument("--grow-step", type=int, default=20)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", nargs="+", default=["hpctrain", "hpctrain.horovod", "horovod"],
                   choices=["hpctrain", "hpctrain.horovod", "horovod"])
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=REPO / "results" / "elastic_grow")
    args = p.parse_args()
    (REPO / "results").mkdir(exist_ok=True)
    runs = []
    for r in range(args.repeats):
        for peer in (args.peers if r % 2 == 0 else args.peers[::-1]):
            runs.append(one_run(peer, args))
            print(runs[-1], flush=True)
    rows = [{"peer": peer, "new_size": [r for r in runs if r["peer"] == peer][0]["new_size"],
             **{k: statistics.median(r[k] for r in runs if r["peer"] == peer) for k in ("grown_s", "lost_steps")}}
            for peer in args.peers]
    lines = [f"A second host of {args.ranks} slots offered at step {args.grow_step} to a job of {args.ranks} ranks, "
             f"commits every {args.commit_every} steps, {args.step_sleep * 1e3:.0f} ms of sleep a step; medians of "
             f"{args.repeats} runs ({CORES}-core machine{', oversubscribed' if 2 * args.ranks > CORES else ''}).\n",
             "| peer | grows to | host offered -> first step of the larger world | steps lost |", "|---|---|---|---|"]
    lines += [f"| {r['peer']} | {r['new_size']} ranks | {r['grown_s']:.2f} s | {r['lost_steps']:g} |" for r in rows]

    def draw(plt):
        fig, ax = plt.subplots(figsize=(6, 2.5))
        ax.barh(range(len(rows)), [r["grown_s"] for r in rows])
        ax.set_yticks(range(len(rows)), [r["peer"] for r in rows])
        ax.set_xlabel("seconds from the host offered to the first step of the larger world")
        return fig

    write_results(args.out, "elastic_grow", {"rows": rows, "runs": runs, "cores": CORES,
                                             "args": {k: str(v) for k, v in vars(args).items()}},
                  "\n".join(lines), draw)


if __name__ == "__main__":
    main()
