"""Recovery from a killed rank: hpctrain's elastic mode against torchrun's restart from a checkpoint.

Same model, data, batch and step time for both (examples/elastic_train.py's regression MLP; each step
sleeps ``--step-sleep`` so that steps take a measurable time), ``--ranks`` ranks, one commit or checkpoint
every ``--commit-every`` steps.  Once rank 0 has printed step ``--kill-step``, the driver SIGKILLs the
process of rank ``--victim`` (found by its launcher's rank variable) and measures:

* ``recovered``: kill -> the first step completed after the recovery (the first ``step`` line after the
  re-forming message, or after torchrun's ``resumed at step``);
* ``lost steps``: the last step done before the job noticed the kill minus the step it went back to;
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

``--fault node`` (needs root) loses a whole node instead: two namespace nodes of scripts/cluster.sh (1 Gbit/s
links), half the ranks on each, every process of node2 SIGKILLed at once (its launcher's daemons and agents
too).  hpctrain and hpctrain.horovod: ``hpctrain launch --elastic -H node1:2,node2:2`` on node1 (Open MPI
reaches node2 through ``cluster.sh ssh``, ssh's place); torchrun: one ``torchrun --nnodes 1:2``
agent a node (c10d rendezvous on node1), the survivors' agent restarts its workers at the smaller size
from the newest checkpoint; Horovod: ``horovodrun`` on node1 with a discovery script naming both nodes,
reaching node2 through the same ``ssh``.  Open MPI's runtime ends the whole job when a node's daemon is lost,
so hpctrain's launcher starts it again on node1 and the ranks load the newest disk checkpoint
(``--disk-every``), then the newest commit node1's memory kept (``--commit-every``; /dev/shm outlives the
processes).

``--fault silent`` cuts node2's link (its processes run on) and ``--fault frozen`` stops every process on it
(SIGSTOP; its kernel still answers): nothing is closed, so only a timeout or a heartbeat tells.  hpctrain's heartbeat across nodes
(``HPCTRAIN_ELASTIC_SILENT_S``, ``--silent-s``, default its default of 8 s) declares node2 lost and node1's ranks
re-form in process;
a peer that has not recovered within ``--timeout`` is ended and counted as not recovered.

    python benchmarks/elastic.py --ranks 4 --repeats 3 --out results/elastic
    python benchmarks/elastic.py --fault node --ranks 4 --repeats 3 --out results/elastic-node
    python benchmarks/elastic.py --fault frozen --ranks 4 --repeats 1 --timeout 120 --out results/elastic-frozen
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
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CORES, write_results  # noqa: E402
from multinode import Nodes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def training_args(args) -> list:
    return ["--samples", str(args.samples), "--epochs", str(args.epochs), "--batch", str(args.batch),
            "--commit-every", str(args.commit_every), "--step-sleep", str(args.step_sleep)]


HOROVOD_WORKER = str(REPO / "benchmarks" / "elastic_horovod_worker.py")


def command(peer: str, args, work: Path) -> list:
    """The command lines of ``peer``'s job (the first one's output is read; on nodes, one a node for torchrun)."""
    nodes = args.fault != "rank"
    hosts = [("localhost", args.ranks - args.ranks // 2), ("127.0.0.1", args.ranks // 2)]
    if nodes:
        hosts = [("node1", args.ranks - args.ranks // 2), ("node2", args.ranks // 2)]
    on = (lambda argv: args.nodes.on("node1", argv)) if nodes else (lambda argv: argv)
    launch = [str(BIN / "hpctrain"), "launch", "--elastic", "-n", str(args.ranks)]
    if nodes:
        launch += ["-H", ",".join(f"{h}:{s}" for h, s in hosts)]
    if peer == "hpctrain":
        # (on nodes, also disk checkpoints at torchrun's interval: a lost daemon ends Open MPI's whole job)
        disk = ["--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", str(args.disk_every)]
        return [on([*launch, str(REPO / "examples" / "elastic_train.py"), *training_args(args), "--log-steps",
                    "--out", str(work / "final.safetensors"), *(disk if nodes else [])])]
    if peer == "hpctrain.horovod":
        return [on([*launch, HOROVOD_WORKER, "--api", "hpctrain.horovod", *training_args(args)])]
    if peer == "horovod":
        # Two hosts (as Horovod's own elastic tests do, this machine twice; or the two nodes): Horovod leaves a
        # failed rank's whole host out, so a kill of the last rank goes on with the first host's half.
        script = work / "discover.sh"
        script.write_text("#!/bin/sh\n" + "".join(f"echo {h}:{s}\n" for h, s in hosts))
        script.chmod(0o755)
        extra = ["--network-interface", "eth0"] if nodes else []
        return [on([str(BIN / "horovodrun"), "-np", str(args.ranks), "--min-np", "1", "--max-np", str(args.ranks),
                    "--host-discovery-script", str(script), *extra, sys.executable,
                    HOROVOD_WORKER, "--api", "horovod", *training_args(args)])]
    worker = [str(REPO / "benchmarks" / "elastic_torchrun_worker.py"), *training_args(args),
              "--ckpt", str(work / "ckpt.pt")]
    if not nodes:
        return [[str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(args.ranks), "--max-restarts", "1",
                 *worker]]
    # One agent a node, rendezvous on node1; the survivors' agent restarts its workers at the smaller size.
    return [args.nodes.on(h, [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", str(s),
                              "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node1:29400",
                              "--rdzv-id", work.name, "--rdzv-conf", "last_call_timeout=2", *worker])
            for h, s in hosts]


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
    node = args.fault != "rank"
    with tempfile.TemporaryDirectory(prefix=f"elastic-{peer}-", dir=args.nodes.shared if node else None) as tmp:
        work = Path(tmp)
        env = dict(args.nodes.env if node else os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   HPCTRAIN_STALL_TIMEOUT_S="120")
        if args.fault in ("silent", "frozen") and peer.startswith("hpctrain"):
            env["HPCTRAIN_ELASTIC_SILENT_S"] = str(args.silent_s)     # (hpctrain's heartbeat across nodes)
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")     # (torchrun --standalone: gloo on the loopback it rendezvouses on)
        first, *others = command(peer, args, work)
        helpers = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(work / f"other{i}.log", "w"),
                                    stderr=subprocess.STDOUT, start_new_session=True)
                   for i, cmd in enumerate(others)]
        proc = subprocess.Popen(first, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        marker = {"hpctrain": "elastic_train.py", "torchrun": "elastic_torchrun_worker.py"}.get(
            peer, f"--api {peer}")
        killed_at = recovered_at = caught_up_at = None
        before = resumed = None
        log = []
        # (a job that hangs silently writes nothing more: end it at the limit, so the loop below ends too)
        def give_up():          # (and what holds its output open: workers in sessions of their own, node1's all)
            for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            if node:
                args.nodes.kill("node1")

        limit = threading.Timer(args.timeout, lambda: proc.poll() is None and give_up())
        limit.start()
        seen = {}         # (node loss, hpctrain: when the launcher said so, restarted, loaded the checkpoint)
        try:
            for line in proc.stdout:
                log.append(line)
                now = time.time()
                text = line.strip()
                m = re.search(r"\bstep (\d+)$", text)
                if m and killed_at is None and int(m.group(1)) >= args.kill_step:
                    before = int(m.group(1))
                    if node:
                        killed_at = time.time()
                        act = {"node": args.nodes.kill, "silent": lambda n: args.nodes.fault("cut", n),
                               "frozen": lambda n: args.nodes.fault("freeze", n)}[args.fault]
                        act("node2")
                    else:
                        pid = victim_pid(marker, args.victim)
                        killed_at = time.time()
                        os.kill(pid, signal.SIGKILL)
                    continue
                if killed_at is None:
                    continue
                for key, said in (("lost", "was lost with Open MPI's daemon"), ("restarted", "hpctrain: elastic mode:")):
                    if said in text:
                        seen.setdefault(key, now)
                r = re.search(r"resumed (?:at|from) step (\d+)", text) or re.search(r"re-formed", text)
                if r and recovered_at is None:      # (the last one before a step: the disk, then the commit)
                    seen["resumed"] = now
                    resumed = int(r.group(1)) if r.groups() else (-1 if resumed is None else resumed)
                    continue
                if m and resumed is None:       # (steps done until the job noticed: lost work too)
                    before = max(before, int(m.group(1)))
                if m and resumed is not None:
                    step = int(m.group(1))
                    if recovered_at is None:
                        recovered_at = now
                    if caught_up_at is None and step >= before:
                        caught_up_at = now
            proc.wait(timeout=args.timeout)
        finally:
            limit.cancel()
            for p in (proc, *helpers):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            if node:
                if args.fault in ("silent", "frozen"):
                    args.nodes.fault("heal" if args.fault == "silent" else "thaw", "node2")
                args.nodes.kill("node1")       # (what a launcher left behind on the nodes)
                args.nodes.kill("node2")
        text = "".join(log)
        if killed_at is None and attempt < 2:
            # (torchrun's gloo start-up on an oversubscribed machine sometimes times out connecting: say so, retry)
            print(f"{peer}: the run failed before the kill (exit status {proc.returncode}); retrying", flush=True)
            return one_run(peer, args, attempt + 1)
        if recovered_at is None and args.fault in ("silent", "frozen") and killed_at is not None:
            return {"peer": peer, "recovered_s": None, "caught_up_s": None, "before": before, "new_size": None,
                    "lost_steps": None, "resumed": None, "status": proc.returncode}
        if "finished:" not in text or recovered_at is None:
            raise RuntimeError(f"{peer}: exit status {proc.returncode}, no recovery seen (within --timeout "
                               f"{args.timeout:g} s):\n{text[-3000:]}")
        row = {"peer": peer, "recovered_s": recovered_at - killed_at, "caught_up_s": caught_up_at - killed_at,
               "before": before}
        if peer == "hpctrain" and args.fault == "node":
            # (the launcher's restart: detection = kill -> its message, re-forming = -> the new job's start,
            # state recovery = -> the checkpoint loaded)
            row.update(detect_s=seen["lost"] - killed_at, reform_s=seen["restarted"] - seen["lost"],
                       recover_s=seen["resumed"] - seen["restarted"], new_size=args.ranks - args.ranks // 2)
            row["redo_s"] = row["caught_up_s"] - (seen["resumed"] - killed_at)
        elif peer == "hpctrain":
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
        row["before"] = before = max(before, resumed)   # (a commit of step s: s was done, though its line was lost)
        row["lost_steps"] = before - resumed
        return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--fault", choices=["rank", "node", "silent", "frozen"], default="rank",
                   help="kill one rank (--victim); or, on two namespace nodes (needs root), kill every process of "
                        "node2, cut its link (silent: its ranks run on), or SIGSTOP every process on it (frozen)")
    p.add_argument("--disk-every", type=int, default=20,
                   help="on nodes, hpctrain's disk checkpoints every this many steps (its commits: --commit-every)")
    p.add_argument("--silent-s", type=float, default=8.0,
                   help="silent and frozen nodes: HPCTRAIN_ELASTIC_SILENT_S for hpctrain (its heartbeat's timeout; "
                        "8 s is its default)")
    p.add_argument("--victim", type=int, default=None, help="rank to kill (default: the last)")
    p.add_argument("--kill-step", type=int, default=30)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--peers", nargs="+", choices=["hpctrain", "torchrun", "horovod", "hpctrain.horovod"],
                   help="default: all four; with --fault node all but hpctrain.horovod (whose worker keeps no disk "
                        "checkpoint to go back to when Open MPI's runtime ends the job)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=REPO / "results" / "elastic")
    args = p.parse_args()
    if args.victim is None:
        args.victim = args.ranks - 1
    if args.peers is None:
        args.peers = ["hpctrain", "torchrun", "horovod"] + (["hpctrain.horovod"] if args.fault == "rank" else [])
    args.nodes = Nodes(2, "1gbit") if args.fault != "rank" else None
    runs = []
    try:
        for r in range(args.repeats):
            for peer in (args.peers if r % 2 == 0 else args.peers[::-1]):
                runs.append(one_run(peer, args))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        if args.nodes:
            args.nodes.down()
    args.nodes = None
    write_outputs(runs, args)


def write_outputs(runs, args) -> None:
    keys = ("recovered_s", "caught_up_s", "lost_steps", "detect_s", "reform_s", "recover_s", "redo_s")
    rows = []
    for peer in args.peers:
        every = [r for r in runs if r["peer"] == peer]
        mine = [r for r in every if r["recovered_s"] is not None]      # (a silent node may never be recovered from)
        row = {"peer": peer, "new_size": mine[0]["new_size"] if mine else None, "recovered": len(mine),
               "runs": len(every)}
        for k in keys:
            vals = [r[k] for r in mine if r.get(k) is not None]
            if vals:
                row[k] = statistics.median(vals)
        rows.append(row)
    base = {r["peer"]: r for r in rows}
    # each peer's time to the first step after recovery over hpctrain's (a peer that never recovered: at least the
    # time it was given)
    over = ({peer: r.get("recovered_s", args.timeout) / base["hpctrain"]["recovered_s"] for peer, r in base.items()
             if peer != "hpctrain"} if base.get("hpctrain", {}).get("recovered_s") else {})
    data = {"rows": rows, "runs": runs, "cores": CORES, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                    for k, v in vars(args).items()},
            "over_hpctrain": over}
    node2 = f"node2 of 2 namespace nodes ({args.ranks // 2} of {args.ranks} ranks"
    lost = {"rank": f"SIGKILL of rank {args.victim} of {args.ranks}",
            "node": f"SIGKILL of {node2}, every process on it)",
            "silent": f"{node2}) cut off (its link down, its processes running)",
            "frozen": f"{node2}) frozen (SIGSTOP of every process on it)"}[args.fault]
    heartbeats = (f"; hpctrain's heartbeat timeout HPCTRAIN_ELASTIC_SILENT_S={args.silent_s:g} s, a run that had not "
                  f"recovered within {args.timeout:g} s was ended" if args.fault in ("silent", "frozen") else "")
    disk = f", hpctrain's disk checkpoints every {args.disk_every}" if args.fault != "rank" else ""
    lines = [f"Recovery from {lost} at step {args.kill_step}, commits or "
             f"checkpoints every {args.commit_every} steps{disk}, {args.step_sleep * 1e3:.0f} ms of sleep a step; "
             f"medians of {args.repeats} runs ({CORES}-core machine{', oversubscribed' if args.ranks > CORES else ''})"
             f"{heartbeats}.\n",
             "| peer | goes on at | kill -> first step after recovery | kill -> back at the pre-kill step | "
             f"steps lost | detection | {'restart (new job)' if args.fault == 'node' else 're-forming'} | "
             f"state recovery{' (disk, then node memory)' if args.fault == 'node' else ''} | redone steps |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "recovered_s" not in r:
            lines.append(f"| {r['peer']} | - | not within {args.timeout:g} s (0 of {r['runs']} runs) | - | - | - | - | - "
                         f"| - |")
            continue
        split = " | ".join(f"{r[k]:.3f} s" if k in r else "-" for k in ("detect_s", "reform_s", "recover_s",
                                                                         "redo_s"))
        some = f" ({r['recovered']} of {r['runs']} runs)" if r["recovered"] < r["runs"] else ""
        lines.append(f"| {r['peer']} | {r['new_size']} ranks | {r['recovered_s']:.2f} s{some} | {r['caught_up_s']:.2f} s "
                     f"| {r['lost_steps']:g} | {split} |")
    if over:
        lines.append("")
    for peer, ratio in over.items():
        never = "" if "recovered_s" in base[peer] else f" at least (it had not recovered at {args.timeout:g} s)"
        lines.append(f"{peer}'s time to the first step after recovery / hpctrain's: {ratio:.1f}x{never}")
    spread = {peer: [None if r["recovered_s"] is None else round(r["recovered_s"], 2) for r in runs
                     if r["peer"] == peer] for peer in args.peers}
    lines.append("\nEach run's kill -> first step after recovery (s): "
                 + "; ".join(f"{peer} {', '.join(map(str, v))}" for peer, v in spread.items()))
    table = "\n".join(lines)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, r in enumerate(rows):
            if "caught_up_s" not in r:
                ax.barh(i, args.timeout, color="lightgrey", hatch="//", label=f"{r['peer']} (not recovered)")
            elif r["peer"] == "hpctrain" and "detect_s" in r:
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
