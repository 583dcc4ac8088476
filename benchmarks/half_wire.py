"""fp16 and bf16 gradients across (namespace) nodes: step time and bytes on the links, against Horovod and DDP.

Needs root: ``scripts/cluster.sh`` builds 2 nodes (own network namespace,
hostname, /dev/shm and /tmp; one link each to a bridge, shaped with tc tbf to
``--rate``).  Each peer trains, 2 nodes x ``--per-node`` ranks, a model with
ResNet-18's 62 parameter tensors (11.7 M float32 values) whose forward is one
multiply-add a parameter, so that a step is its gradient exchange: what each
framework's own data-parallel wrapper does with the gradients a backward
pass produced, through its own hooks:

* ``hpctrain``  ``hpctrain.torch.DistributedOptimizer(compression=none|fp16|bf16)`` (MPI backend);
* ``horovod``   Horovod 0.28.1's ``DistributedOptimizer(compression=Compression.none|fp16)`` (no bf16 there);
* ``hpctrain.horovod``  the same script on ``hpctrain.horovod.torch`` (hpctrain's Horovod API, MPI backend);
* ``ddp``       ``DistributedDataParallel`` over gloo, with ``fp16_compress_hook`` (its ``bf16_compress_hook``
  refuses anything but CUDA with NCCL).

Each (peer, compression) runs in its own mpirun launch from node1, the order
alternating between rounds.  A step's time is the median over the timed
steps and rounds.  The bytes are the nodes' own count: the first rank of
each node reads its ``eth0`` counters (rx + tx bytes, /proc/net/dev) before and after the
timed steps, so start-up, the parameters' broadcast and warm-up are left
out; the table gives bytes per step per node.

Writes ``half_wire.json``, ``half_wire.md`` and ``half_wire.png`` under ``--out``.

    sudo .venv/bin/python benchmarks/half_wire.py --out results/half-wire
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
from common import free_port, write_results  # noqa: E402
from multinode import Nodes  # noqa: E402

PEERS = ("hpctrain", "hpctrain.horovod", "horovod", "ddp")
RUNS = (("hpctrain", "none"), ("hpctrain", "fp16"), ("hpctrain", "bf16"), ("hpctrain.horovod", "none"),
        ("hpctrain.horovod", "fp16"), ("horovod", "none"), ("horovod", "fp16"), ("ddp", "none"), ("ddp", "fp16"))


# ---------------------------------------------------------------- worker (one launch, one peer and compression)
def link_bytes() -> int:
    """rx + tx bytes of this node's eth0 so far: /proc/net/dev, which shows the reading process's network
    namespace (the node's own link; /sys/class/net there would be the host's)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counts = line.partition(":")
        if name.strip() == "eth0":
            fields = counts.split()
            return int(fields[0]) + int(fields[8])
    raise SystemExit("no eth0 in /proc/net/dev: run on the namespace nodes of scripts/cluster.sh")


def worker(peer: str, compression: str, steps: int) -> None:
    import torch
    from mpi4py import MPI

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "horovod"))
    from resnets import resnet18

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    first_on_node = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank() == 0

    class Shapes(torch.nn.Module):
        """ResNet-18's parameters; the loss is sum(c * p) over them, so the gradients are c everywhere."""

        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(p.detach().clone() for p in resnet18().parameters())

        def forward(self, c):
            return sum((p * c).sum() for p in self.ps)

    torch.manual_seed(0)
    model = Shapes()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    if peer == "hpctrain":
        import hpctrain
        import hpctrain.torch as ht

        hpctrain.init("mpi")
        optimizer = ht.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=None if compression == "none" else compression)
    elif peer in ("horovod", "hpctrain.horovod"):
        import importlib

        hvd = importlib.import_module(f"{peer}.torch")
        hvd.init()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=getattr(hvd.Compression, compression))
    else:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        dist.init_process_group("gloo", init_method=f"tcp://{os.environ['BENCH_MASTER']}:{os.environ['BENCH_PORT']}",
                                rank=rank, world_size=size)
        model = torch.nn.parallel.DistributedDataParallel(model)
        if compression != "none":
            model.register_comm_hook(None, getattr(default_hooks, f"{compression}_compress_hook"))
    c = torch.tensor(float(rank + 1))

    def step():
        optimizer.zero_grad()
        model(c).backward()
        optimizer.step()

    for _ in range(3):      # warm-up: buffers, buckets, Horovod's response cache
        step()
    world.Barrier()
    before = link_bytes()
    times = []
    for _ in range(steps):
        world.Barrier()
        t0 = time.perf_counter()
        step()
        world.Barrier()
        times.append(time.perf_counter() - t0)
    moved = link_bytes() - before
    per_node = [b for b in world.gather(moved if first_on_node else None) or [] if b is not None]
    grad = next(model.parameters()).grad
    if rank == 0:
        print("RESULT " + json.dumps({"times": times, "bytes_per_step_per_node": [b / steps for b in per_node],
                                      "values": sum(p.numel() for p in model.parameters()),
                                      "grad": float(grad.reshape(-1)[0])}), flush=True)


# ---------------------------------------------------------------- driver
def measure(args) -> dict:
    nodes = Nodes(2, args.rate)
    runs = [r for r in RUNS if r[0] in args.peers and r[1] in args.compressions]
    data = {"rate": args.rate, "per_node": args.per_node, "rounds": args.rounds, "steps": args.steps,
            "step_s": {}, "bytes_per_step_per_node": {}, "grad": {}}
    try:
        data["link_gbit"] = nodes.link_gbit()
        for rnd in range(args.rounds):
            for peer, comp in (runs if rnd % 2 == 0 else runs[::-1]):
                key = f"{peer} {comp}"
                res = nodes.launch(2, [__file__, "--worker", peer, "--compression", comp, "--steps", args.steps],
                                   per_node=args.per_node, timeout=900, BENCH_MASTER="198.18.0.1",
                                   BENCH_PORT=str(free_port()), OMPI_MCA_threads_pthreads_yield_strategy="nanosleep")
                data["step_s"].setdefault(key, []).extend(res["times"])
                data["bytes_per_step_per_node"].setdefault(key, []).extend(res["bytes_per_step_per_node"])
                data["grad"][key] = res["grad"]
                data["values"] = res["values"]
                print(f"round {rnd + 1}/{args.rounds} {key}: median step "
                      f"{statistics.median(res['times']) * 1e3:.1f} ms, "
                      f"{statistics.median(res['bytes_per_step_per_node']) / 1e6:.1f} MB a step per node",
                      file=sys.stderr, flush=True)
    finally:
        nodes.down()
    return data


def write_outputs(data: dict, out: Path) -> None:
    step = {k: statistics.median(v) for k, v in data["step_s"].items()}
    moved = {k: statistics.median(v) for k, v in data["bytes_per_step_per_node"].items()}
    data["median_step_s"], data["median_bytes_per_step_per_node"] = step, moved
    lines = [f"Gradients of ResNet-18's shapes ({data['values']:,} float32 values) across 2 namespace nodes x "
             f"{data['per_node']} ranks, links shaped to {data['rate']} (one TCP stream measured "
             f"{data['link_gbit']:.2f} Gbit/s); median over {data['steps']} steps x {data['rounds']} rounds; bytes: "
             f"each node's eth0 (rx + tx) during the timed steps", "",
             "| peer | compression | step (ms) | / its none | MB a step per node | / its none |",
             "|---|---|---|---|---|---|"]
    for key in step:
        peer, comp = key.split()
        none = f"{peer} none"
        lines.append(f"| {peer} | {comp} | {step[key] * 1e3:.1f} | "
                     + (f"{step[key] / step[none]:.2f}" if none in step else "-") + f" | {moved[key] / 1e6:.1f} | "
                     + (f"{moved[key] / moved[none]:.2f}" if none in moved else "-") + " |")
    for comp in ("fp16", "bf16"):
        mine = step.get(f"hpctrain {comp}")
        peers = {k: v for k, v in step.items() if k.endswith(f" {comp}") and k.split()[0] in ("horovod", "ddp")}
        if mine and peers:
            best = min(peers, key=peers.get)
            data[f"hpctrain_{comp}_over_best_peer"] = mine / peers[best]
            lines.append(f"\nhpctrain {comp} step / the faster peer's ({best}): {mine / peers[best]:.2f}")
    table = "\n".join(lines)

    def draw(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        keys = list(step)
        a.barh(keys, [step[k] * 1e3 for k in keys])
        a.set_xlabel("median step (ms)")
        b.barh(keys, [moved[k] / 1e6 for k in keys])
        b.set_xlabel("MB on each node's link a step")
        fig.suptitle(f"fp16/bf16 on the wire: 2 namespace nodes x {data['per_node']}, {data['rate']}", fontsize=10)
        fig.tight_layout()
        return fig

    write_results(out, "half_wire", data, table, draw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    ap.add_argument("--compressions", nargs="+", default=["none", "fp16", "bf16"], choices=["none", "fp16", "bf16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per launch")
    ap.add_argument("--out", default="results/half-wire")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--compression", default="none", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.compression, args.steps)
        return
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/half_wire.py builds network and mount namespaces: run it as root")
    write_outputs(measure(args), Path(args.out))


if __name__ == "__main__":
    main()
