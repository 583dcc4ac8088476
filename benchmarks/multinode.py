"""All-reduce across real (namespace) nodes on shaped links: hpctrain's algorithms against MPI_Allreduce and Horovod.

Needs root: ``scripts/cluster.sh`` builds 3 nodes (own network namespace,
hostname, /dev/shm and /tmp; one link each to a bridge, shaped with tc tbf).
For each link rate (default 1 and 10 Gbit/s) it first measures the link with
one TCP stream, then, for 2 and 3 nodes x 2 ranks per node, runs every peer
in its own mpirun launch from node1 (the worker of ``benchmarks/allreduce.py``:
the same buffers, warm-up and per-size median), alternating the peers' order
between rounds.  A peer's time is the median over rounds.

Bus bandwidth as nccl-tests defines it, ``busbw = S / t * 2 (p-1) / p`` for
``S`` bytes on ``p`` ranks: for a ring it is what each node's link carries
per second, so ``busbw / link rate`` is the share of the link a ring uses.
The hierarchical all-reduce sends less over the links (``2 (n-1)/n S`` per
node for ``n`` nodes, against ``2 (p-1)/p S`` for a ring over all ranks), so
its busbw can pass the link rate.

At the first rate, on 2 nodes, also the step time of exchanging ResNet-18's
gradients (62 float32 tensors, 11.7 M values) through hpctrain's
``GradientAverager`` (what both adapters call) with none, fp16, topk
(1 %) and powersgd (rank 4) compression: median over steps and rounds.

Writes ``multinode.json`` (also the measurements ``benchmarks/model.py``
fits), ``multinode.md`` and ``multinode.png`` under ``--out``.

    sudo .venv/bin/python benchmarks/multinode.py --out results/multinode
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import result_of, write_results  # noqa: E402
from hpctrain.launcher.launch import TCP_FLAGS_WITHOUT_PUT  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "scripts" / "cluster.sh"
ALLREDUCE = str(REPO / "benchmarks" / "allreduce.py")
PEERS = ("hpctrain-auto", "hpctrain-hierarchical", "hpctrain-ring", "hpctrain-native", "mpi4py", "mpi4py-flat",
         "horovod", "hpctrain-elastic")
# Open MPI 5's MPI_Allreduce is hierarchical itself across nodes (its coll/han component); "mpi4py-flat"
# is the same call with han off, the flat algorithms of coll/tuned.  "hpctrain-elastic" is "auto" in a world
# that re-forms, as `hpctrain launch --elastic` starts it: the library's all-reduce left out, han off, and the
# TCP transport's emulated put off (hpctrain/launcher/launch.py says why).
PEER_ENV = {"mpi4py-flat": {"OMPI_MCA_coll": "^han"},
            "hpctrain-elastic": {"OMPI_MCA_coll": "^han,cuda", "HPCTRAIN_ELASTIC": "1",
                                 "OMPI_MCA_btl_tcp_flags": TCP_FLAGS_WITHOUT_PUT}}
WORKER_PEER = {"hpctrain-elastic": "hpctrain-auto"}
COMPRESSION = {"none": None, "fp16": "fp16", "topk": "topk:ratio=0.01", "powersgd": "powersgd:rank=4,start_iter=0"}
MIB = 1 << 20
PER_NODE = 2


# ---------------------------------------------------------------- worker: ResNet-18's gradient exchange
def exchange_worker(method: str, steps: int) -> None:
    import hpctrain
    import hpctrain.compression
    from hpctrain.gradients import GradientAverager

    sys.path.insert(0, str(REPO / "examples" / "horovod"))
    from resnets import resnet18

    comm = hpctrain.init("mpi")
    named = [(name, p.shape) for name, p in resnet18().named_parameters()]
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(tuple(shape)).astype(np.float32) for _, shape in named]
    spec = COMPRESSION[method]
    averager = GradientAverager(comm, "avg", hpctrain.compression.from_spec(spec) if spec else None)
    names = [name for name, _ in named]
    times = []
    for step in range(steps + 3):                     # 3 warm-up steps
        comm.barrier()
        t0 = time.perf_counter()
        averager.reduce(grads, names)
        if step >= 3:
            times.append(time.perf_counter() - t0)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"method": method, "times": times,
                                      "values": int(sum(g.size for g in grads)), "tensors": len(grads)}), flush=True)
    hpctrain.shutdown()


# ---------------------------------------------------------------- driver
class Nodes:
    """The fake nodes of scripts/cluster.sh, owned by this process (gone when it ends, killed too)."""

    def __init__(self, count: int, rate: str):
        self.env = dict(os.environ, HPCTRAIN_CLUSTER_DIR=f"/run/hpctrain-bench-{os.getpid()}",
                        MPIRUN=str(Path(sys.executable).parent / "mpirun"), OMP_NUM_THREADS="1",
                        TF_CPP_MIN_LOG_LEVEL="3", OMPI_MCA_mpi_yield_when_idle="1")
        self.script([CLUSTER, "up", str(count), "--rate", rate, "--keep", REPO, "--owner", str(os.getpid())])

    def script(self, args, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in args], env=self.env, check=True, capture_output=True, text=True,
                              **kw)

    def reshape(self, rate: str) -> None:
        self.script([CLUSTER, "rate", rate])

    def down(self) -> None:
        subprocess.run([str(CLUSTER), "down"], env=self.env, capture_output=True)

    @property
    def shared(self) -> Path:
        """The directory every node sees (a cluster's shared file system)."""
        return Path(self.env["HPCTRAIN_CLUSTER_DIR"]) / "shared"

    def on(self, node: str, argv) -> list:
        """The command line that runs the launcher ``argv`` on ``node`` (in the current directory), reaching the
        other nodes as it would through ssh (``cluster.sh launcher``)."""
        return [str(CLUSTER), "launcher", node, *map(str, argv)]

    def kill(self, node: str) -> None:
        """A node crash: SIGKILL to everything running on ``node`` at once."""
        self.script([CLUSTER, "kill", node])

    def fault(self, action: str, node: str) -> None:
        """``cut`` (its link down), ``heal``, ``freeze`` (SIGSTOP of every process on it) or ``thaw`` ``node``."""
        self.script([CLUSTER, action, node])

    def launch(self, nodes: int, argv, timeout: float = 1800, per_node: int = PER_NODE, **env) -> dict:
        hosts = ",".join(f"node{i}:{per_node}" for i in range(1, nodes + 1))
        cmd = [str(CLUSTER), "mpirun", "-H", hosts, sys.executable, *map(str, argv)]
        return result_of(subprocess.run(cmd, capture_output=True, text=True, env={**self.env, **env},
                                        timeout=timeout), argv)

    def link_gbit(self, seconds: float = 2.0) -> float:
        """One TCP stream from node1 to node2 for ``seconds``: Gbit/s of payload."""
        server = ("import socket; s = socket.create_server(('198.18.0.2', 7997)); c, _ = s.accept()\n"
                  "while c.recv(1 << 20): pass\nc.sendall(b'k')")
        client = ("import socket, sys, time; c = socket.create_connection(('198.18.0.2', 7997)); "
                  "b = bytes(4 << 20); n = 0; t = time.perf_counter()\n"
                  f"while time.perf_counter() - t < {seconds}: c.sendall(b); n += len(b)\n"
                  "c.shutdown(socket.SHUT_WR); c.recv(1); print(n * 8 / (time.perf_counter() - t) / 1e9)")
        listener = subprocess.Popen([str(CLUSTER), "exec", "node2", sys.executable, "-c", server], env=self.env)
        try:
            for _ in range(50):
                res = subprocess.run([str(CLUSTER), "exec", "node1", sys.executable, "-c", client], env=self.env,
                                     capture_output=True, text=True)
                if res.returncode == 0:
                    return float(res.stdout.strip())
                time.sleep(0.1)
            raise RuntimeError(f"link test failed: {res.stderr}")
        finally:
            listener.wait(timeout=30)


def rate_gbit(rate: str) -> float:
    """Gbit/s of a tc rate such as 1gbit, 10gbit or 500mbit."""
    m = re.fullmatch(r"([0-9.]+)([mg])bit", rate.lower())
    if not m:
        raise SystemExit(f"--rates: expected rates such as 1gbit, 10gbit or 500mbit, not {rate!r}")
    return float(m.group(1)) / (1 if m.group(2) == "g" else 1e3)


def measure(args) -> dict:
    data = {"rounds": args.rounds, "per_node": PER_NODE, "rates": {}, "exchange": {}}
    cluster = Nodes(max(args.nodes), args.rates[0])
    try:
        for i, rate in enumerate(args.rates):
            if i:
                cluster.reshape(rate)
            entry = data["rates"][rate] = {"gbit": rate_gbit(rate), "link_gbit": cluster.link_gbit(), "runs": {}}
            for nodes in args.nodes:
                runs = {p: [] for p in args.peers}
                for rnd in range(args.rounds):
                    for peer in (args.peers if rnd % 2 == 0 else args.peers[::-1]):
                        print(f"[{rate}, {nodes} nodes, round {rnd + 1}/{args.rounds}] {peer}", file=sys.stderr,
                              flush=True)
                        res = cluster.launch(nodes, [ALLREDUCE, "--worker", WORKER_PEER.get(peer, peer),
                                                     "--seconds", args.seconds,
                                                     "--sizes", *args.sizes], **PEER_ENV.get(peer, {}))
                        runs[peer].append({int(k): v for k, v in res["times"]["allreduce"].items()})
                entry["runs"][str(nodes)] = {p: {str(s): statistics.median(r[s] for r in runs[p]) for s in args.sizes}
                                             for p in args.peers}
            if i == 0 and args.methods:
                steps = {m: [] for m in args.methods}
                for rnd in range(args.rounds):
                    for m in (args.methods if rnd % 2 == 0 else args.methods[::-1]):
                        print(f"[{rate}, 2 nodes, round {rnd + 1}/{args.rounds}] ResNet-18 exchange {m}",
                              file=sys.stderr, flush=True)
                        res = cluster.launch(2, [__file__, "--exchange-worker", m, "--steps", args.steps])
                        steps[m] += res["times"]
                        data["exchange"]["values"] = res["values"]
                data["exchange"].update(rate=rate, nodes=2,
                                        step_s={m: statistics.median(t) for m, t in steps.items()})
    finally:
        cluster.down()
    return data


def rows_of(data: dict):
    """(rate, nodes, peer, bytes, seconds, busbw GB/s, busbw / link rate) for every measurement."""
    out = []
    for rate, entry in data["rates"].items():
        for nodes, peers in entry["runs"].items():
            p = int(nodes) * data["per_node"]
            for peer, times in peers.items():
                for size, t in times.items():
                    busbw = int(size) / t * 2 * (p - 1) / p
                    out.append((rate, int(nodes), peer, int(size), t, busbw / 1e9, busbw * 8 / 1e9 / entry["gbit"]))
    return out


def human(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // 1024} KiB"


def write_outputs(data: dict, out: Path) -> None:
    rows = rows_of(data)
    peers = list(dict.fromkeys(r[2] for r in rows))
    lines = []
    for rate, entry in data["rates"].items():
        for nodes in entry["runs"]:
            lines += [f"\n### {nodes} nodes x {data['per_node']} ranks, links {rate} (one TCP stream measured "
                      f"{entry['link_gbit']:.2f} Gbit/s): bus bandwidth GB/s, median of {data['rounds']} rounds\n",
                      "busbw/link: the best hpctrain ring or hierarchical busbw over the link rate; hier/MPI and "
                      "auto/MPI: time of MPI_Allreduce (mpi4py, Open MPI's fastest: its hierarchical han) over "
                      "hpctrain's; hier/flat MPI: the same against MPI_Allreduce with han off; auto/Horovod: "
                      "Horovod's time over auto's (higher is better)\n",
                      "| size | " + " | ".join(peers) + " | busbw/link | hier/MPI | auto/MPI | hier/flat MPI "
                      "| auto/Horovod |",
                      "|---" * (len(peers) + 6) + "|"]
            for size in sorted({r[3] for r in rows}):
                cell = {r[2]: r for r in rows if r[0] == rate and r[1] == int(nodes) and r[3] == size}
                t = {p: cell[p][4] for p in cell}
                link = max((cell[p][6] for p in ("hpctrain-ring", "hpctrain-hierarchical") if p in cell),
                           default=float("nan"))

                def ratio(a, b):
                    return f"{t[a] / t[b]:.2f}" if a in t and b in t else "-"
                lines.append(f"| {human(size)} | " + " | ".join(f"{cell[p][5]:.3f}" for p in peers if p in cell)
                             + f" | {link:.0%} | {ratio('mpi4py', 'hpctrain-hierarchical')} | "
                             + f"{ratio('mpi4py', 'hpctrain-auto')} | "
                             + f"{ratio('mpi4py-flat', 'hpctrain-hierarchical')} | "
                             + f"{ratio('horovod', 'hpctrain-auto')} |")
    ex = data.get("exchange") or {}
    if ex.get("step_s"):
        base = ex["step_s"].get("none")
        lines += [f"\n### ResNet-18 gradient exchange ({ex['values']:,} float32 values), {ex['nodes']} nodes x "
                  f"{data['per_node']} ranks, links {ex['rate']}: median step time\n",
                  "| compression | step time (s) | speed-up over none |", "|---|---|---|"]
        for m, t in ex["step_s"].items():
            lines.append(f"| {m} | {t:.3f} | {base / t:.2f}x |" if base else f"| {m} | {t:.3f} | - |")
    table = "\n".join(lines)

    def draw(plt):
        panels = [(rate, nodes) for rate, e in data["rates"].items() for nodes in e["runs"]]
        fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
        for ax, (rate, nodes) in zip(axes[0], panels):
            for peer in peers:
                pts = sorted((r[3], r[5]) for r in rows if r[0] == rate and r[1] == int(nodes) and r[2] == peer)
                ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=peer)
            ax.axhline(data["rates"][rate]["gbit"] / 8, color="grey", linestyle="--", label="link rate")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.set_title(f"{nodes} nodes x {data['per_node']}, {rate}")
            ax.legend(fontsize=7)
        return fig

    write_results(out, "multinode", data, table, draw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", nargs="+", default=["1gbit", "10gbit"])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--methods", nargs="*", default=list(COMPRESSION), choices=list(COMPRESSION))
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 64 * 1024, MIB, 4 * MIB, 16 * MIB, 64 * MIB])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0, help="time budget per size and launch")
    ap.add_argument("--steps", type=int, default=10, help="ResNet-18 exchange steps per launch")
    ap.add_argument("--out", default="results/multinode")
    ap.add_argument("--exchange-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.exchange_worker:
        exchange_worker(args.exchange_worker, args.steps)
        return
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/multinode.py builds network and mount namespaces: run it as root")
    write_outputs(measure(args), Path(args.out))


if __name__ == "__main__":
    main()
