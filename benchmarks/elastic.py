"""Recovery from a killed rank: hpctrain's elastic mode against torchrun's restart from a checkpoint.

Same model, data, batch and step time for both (examples/elastic_train.py's regression MLP; each step
sleeps ``--step-sleep`` so that steps take a measurable time), ``--ranks`` ranks, one commit or checkpoint
every ``--commit-every`` steps.  Once rank 0 has printed step ``--kill-step``, the driver SIGKILLs the
process of rank ``--victim`` (found by its launcher's rank variable) and measures:

* ``recovered``: kill -> the first step completed after the recovery (the first ``step`` line after the
  re-forming message, or after torchrun's ``resumed at step``);
* ``lost steps``: the last step done before the kill minus the step the job went back to;
* ``caught up``: kill -> the job again at the step it had reached before the kill;
* for hpctrain the split of the lost time: detection (kill -> the survivors' WorldFailedError), re-forming
  (shrink, new world), state recovery (agree on a commit, restore, broadcast), redone steps.

Peers: ``hpctrain``: ``hpctrain launch --elastic``: the survivors go on at ``ranks - 1``; ``torchrun``:
``torchrun --max-restarts 1`` over DDP (gloo) with torch.save checkpoints (benchmarks/elastic_torchrun_worker.py):
every worker is restarted at the same size and resumes from the newest checkpoint; ``horovod``: the real
Horovod 0.28.1's elastic mode (``horovodrun`` with a host-discovery script naming this machine twice, as
``localhost`` and ``127.0.0.1``, half the ranks each: Horovod leaves a failed rank's whole host out, so it goes
on with the other half; its survivors notice the loss when their Gloo collective times out, 30 s by default,
``HOROVOD_GLOO_TIMEOUT_SECONDS``), benchmarks/elastic_horovod_worker.py; ``hpctrain.horovod``: the same worker on
hpctrain.horovod under ``hpctrain launch --elastic``.  Medians over ``--repeats``, the peers alternating.

    python benchmarks/elastic.py --ranks 4 --repeats 3 --out results/elastic
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CORES, write_results  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def training_args(args) -> list:
    return ["--samples", str(args.samples), "--epochs", str(args.epochs), "--batch", str(args.batch),
            "--commit-every", str(args.commit_every), "--step-sleep", str(args.step_sleep)]


HOROVOD_WORKER = str(REPO / "benchmarks" / "elastic_horovod_worker.py")


def command(peer: str, args, work: Path) -> list:
    if peer == "hpctrain":
        return [str(BIN / "hpctrain"), "launch", "--elastic", "-n", str(args.ranks),
                str(REPO / "examples" / "elastic_train.py"), *training_args(args), "--log-steps",
                "--out", str(work / "final.safetensors")]
    if peer == "hpctrain.horovod":
        return [str(BIN / "hpctrain"), "launch", "--elastic", "-n", str(args.ranks), HOROVOD_WORKER,
                "--api", "hpctrain.horovod", *training_args(args)]
    if peer == "horovod":
        # Two "hosts" of this machine (as Horovod's own elastic tests do): Horovod leaves a failed rank's whole
        # host out, so a kill of the last rank goes on with the first host's half.
        half = args.ranks // 2
        script = work / "discover.sh"
        script.write_text(f"#!/bin/sh\necho localhost:{args.ranks - half}\necho 127.0.0.1:{half}\n")
        script.chmod(0o755)
        return [str(BIN / "horovodrun"), "-np", str(args.ranks), "--min-np", "1", "--max-np", str(args.ranks),
                "--host-discovery-script", str(script), sys.executable,
                HOROVOD_WORKER, "--api", "horovod", *training_args(args)]
    return [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(args.ranks), "--max-restarts", "1",
            str(REPO / "benchmarks" / "elastic_torchrun_worker.py"), *training_args(args),
            "--ckpt", str(work / "ckpt.pt")]


def victim_pid(marker: str, rank: int) -> int:
    """The pid of the training process of ``rank`` (its launcher's rank variable) running ``marker``."""
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmdline = p.info["cmdline"] or [""]
            if "python" in cmdline[0] and marker in " ".join(cmdline):
                env = p.environ()      # (mpirun's ranks have OMPI_COMM_WORLD_RANK, torchrun's RANK, Horovod's)
                if env.get("OMPI_COMM_WORLD_RANK", env.get("RANK", env.get("HOROVOD_RANK"))) == str(rank):
                    return p.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise RuntimeError(f"no process of rank {rank} running {marker}")


def one_run(peer: str, args, attempt: int = 0) -> dict:
    """Launch, kill the victim at the kill step, and time the recovery."""
    with tempfile.TemporaryDirectory(prefix=f"elastic-{peer}-") as tmp:
        work = Path(tmp)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HPCTRAIN_STALL_TIMEOUT_S="120")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")     # (torchrun --standalone: gloo on the loopback it rendezvouses on)
        proc = subprocess.Popen(command(peer, args, work), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        marker = {"hpctrain": "elastic_train.py", "torchrun": "elastic_torchrun_worker.py"}.get(
            peer, f"--api {peer}")
        killed_at = recovered_at = caught_up_at = None
        before = resumed = None
        log = []
        try:
            for line in proc.stdout:
                log.append(line)
                now = time.time()
                text = line.strip()
                m = re.search(r"\bstep (\d+)$", text)
                if m and killed_at is None and int(m.group(1)) >= args.kill_step:
                    before = int(m.group(1))
                    pid = victim_pid(marker, args.victim)
                    killed_at = time.time()
                    os.kill(pid, signal.SIGKILL)
                    continue
                if killed_at is None:
                    continue
                r = re.search(r"resumed at step (\d+)", text) or re.search(r"re-formed", text)
                if r and resumed is None:
                    resumed = int(r.group(1)) if r.groups() else -1
                    continue
                if m and resumed is not None:
                    step = int(m.group(1))
                    if recovered_at is None:
                        recovered_at = now
                    if caught_up_at is None and step >= before:
                        caught_up_at = now
            proc.wait(timeout=args.timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        text = "".join(log)
        if killed_at is None and attempt < 2:
            # (torchrun's gloo start-up on an oversubscribed machine sometimes times out connecting: say so, retry)
            print(f"{peer}: the run failed before the kill (exit status {proc.returncode}); retrying", flush=True)
            return one_run(peer, args, attempt + 1)
        if "finished:" not in text or recovered_at is None:
            raise RuntimeError(f"{peer}: exit status {proc.returncode}, no recovery seen:\n{text[-3000:]}")
        row = {"peer": peer, "recovered_s": recovered_at - killed_at, "caught_up_s": caught_up_at - killed_at,
               "before": before}
        if peer == "hpctrain":
            summary = json.loads((work / "final.safetensors.json").read_text())
            rec = summary["recoveries"][0]
            resumed = summary["resumed_at"][0]
            row.update(detect_s=rec["failed_at"] - killed_at, reform_s=rec["reform_s"], recover_s=rec["recover_s"],
                       new_size=rec["new_size"])
            row["redo_s"] = row["caught_up_s"] - row["detect_s"] - row["reform_s"] - row["recover_s"]
        else:
            sizes = re.findall(r"finished: \d+ steps, world of (\d+)", text)
            row["new_size"] = int(sizes[-1]) if sizes else args.ranks
        row["resumed"] = resumed
        row["lost_steps"] = before - resumed
        return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--victim", type=int, default=None, help="rank to kill (default: the last)")
    p.add_argument("--kill-step", type=int, default=30)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", nargs="+", default=["hpctrain", "torchrun", "horovod", "hpctrain.horovod"],
                   choices=["hpctrain", "torchrun", "horovod", "hpctrain.horovod"])
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=REPO / "results" / "elastic")
    args = p.parse_args()
    if args.victim is None:
        args.victim = args.ranks - 1
    runs = []
    for r in range(args.repeats):
        for peer in (args.peers if r % 2 == 0 else args.peers[::-1]):
            runs.append(one_run(peer, args))
            print(json.dumps(runs[-1]), flush=True)
    write_outputs(runs, args)


def write_outputs(runs, args) -> None:
    keys = ("recovered_s", "caught_up_s", "lost_steps", "detect_s", "reform_s", "recover_s", "redo_s")
    rows = []
    for peer in args.peers:
        mine = [r for r in runs if r["peer"] == peer]
        row = {"peer": peer, "new_size": mine[0]["new_size"]}
        for k in keys:
            vals = [r[k] for r in mine if k in r]
            if vals:
                row[k] = statistics.median(vals)
        rows.append(row)
    base = {r["peer"]: r for r in rows}
    # each peer's time to the first step after recovery over hpctrain's
    over = ({peer: r["recovered_s"] / base["hpctrain"]["recovered_s"] for peer, r in base.items() if peer != "hpctrain"}
            if "hpctrain" in base else {})
    data = {"rows": rows, "runs": runs, "cores": CORES, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                    for k, v in vars(args).items()},
            "over_hpctrain": over}
    lines = [f"Recovery from SIGKILL of rank {args.victim} of {args.ranks} at step {args.kill_step}, commits or "
             f"checkpoints every {args.commit_every} steps, {args.step_sleep * 1e3:.0f} ms of sleep a step; medians "
             f"of {args.repeats} runs ({CORES}-core machine{', oversubscribed' if args.ranks > CORES else ''}).\n",
             "| peer | goes on at | kill -> first step after recovery | kill -> back at the pre-kill step | "
             "steps lost | detection | re-forming | state recovery | redone steps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        split = " | ".join(f"{r[k]:.3f} s" if k in r else "-" for k in ("detect_s", "reform_s", "recover_s",
                                                                         "redo_s"))
        lines.append(f"| {r['peer']} | {r['new_size']} ranks | {r['recovered_s']:.2f} s | {r['caught_up_s']:.2f} s | "
                     f"{r['lost_steps']:g} | {split} |")
    if over:
        lines.append("")
    for peer, ratio in over.items():
        lines.append(f"{peer}'s time to the first step after recovery / hpctrain's: {ratio:.1f}x")
    table = "\n".join(lines)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, r in enumerate(rows):
            if r["peer"] == "hpctrain":
                left = 0.0
                for k, label in (("detect_s", "detection"), ("reform_s", "re-forming"),
                                 ("recover_s", "state recovery"), ("redo_s", "redone steps")):
                    ax.barh(i, r[k], left=left, label=label)
                    left += r[k]
            else:
                ax.barh(i, r["caught_up_s"], label=f"{r['peer']} (until back at the pre-kill step)", color="grey")
        ax.set_yticks(range(len(rows)), [r["peer"] for r in rows])
        ax.set_xlabel("seconds from the kill until back at the pre-kill step")
        ax.legend(fontsize=8)
        return fig

    write_results(args.out, "elastic", data, table, draw)


if __name__ == "__main__":
    main()
