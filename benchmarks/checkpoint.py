"""Checkpoint speed: synchronous save, the training stall of an asynchronous save, restore; vs the disk and torch.save.

For each state size (float32 tensors of 25 MiB or less, like a model's
layers) and repeat, in one process:

* ``disk``: the disk's own write bandwidth: one plain file of the same size,
  written with ``write`` and ``fsync``;
* ``sync``: ``CheckpointManager(async_save=False).save()``: encode, write with
  CRC-32, fsync, manifest, atomic rename;
* ``stall``: how long ``save()`` blocks the training loop with
  ``async_save=True`` (plan + copy to host memory, by the default number of
  copy threads; ``stall, 1 thread`` with one); ``async total`` adds the
  background write up to the commit in ``wait()``;
* ``restore``: ``CheckpointManager.restore()`` of that checkpoint (read, verify, copy in);
* ``torch.save``: the peer most scripts use: ``torch.save`` of the same tensors + ``fsync``.

Medians over ``--repeats``; the checkpoint directory is emptied between runs.

    python benchmarks/checkpoint.py --sizes-mb 10 100 1000 --out results/checkpoint
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import CORES, write_results  # noqa: E402

CHUNK = 25 * 2 ** 20 // 4   # float32 values per tensor


def make_state(mb: int):
    """A dict of float32 torch tensors totalling ``mb`` MB (10^6 bytes)."""
    import torch

    values = mb * 10 ** 6 // 4
    tensors, i = {}, 0
    while values > 0:
        n = min(CHUNK, values)
        tensors[f"layer{i}.weight"] = torch.full((n,), float(i), dtype=torch.float32)
        values -= n
        i += 1
    return tensors


def disk_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` to a new file and fsync it."""
    buf = np.ones(nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(buf))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def measure(mb: int, root: Path) -> dict:
    import torch

    from hpctrain.checkpoint import CheckpointManager

    class Holder:     # a module-like object: state_dict / load_state_dict, as a model would be
        def __init__(self, tensors):
            self.tensors = tensors

        def state_dict(self):
            return self.tensors

        def load_state_dict(self, sd):
            for k, v in sd.items():
                self.tensors[k].copy_(v)

    tensors = make_state(mb)
    nbytes = sum(t.numel() * 4 for t in tensors.values())
    state = {"model": Holder(tensors), "step": 0}
    out = {"bytes": nbytes}
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out["disk_s"] = disk_write(root / "plain.bin", nbytes)
    (root / "plain.bin").unlink()

    t0 = time.perf_counter()
    with open(root / "torch.pt", "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    out["torch_save_s"] = time.perf_counter() - t0
    (root / "torch.pt").unlink()

    sync = CheckpointManager(str(root / "sync"), keep=1, async_save=False)
    t0 = time.perf_counter()
    sync.save(1, state)
    out["sync_s"] = time.perf_counter() - t0

    for t in tensors.values():
        t.zero_()
    t0 = time.perf_counter()
    assert sync.restore(state) == 1
    out["restore_s"] = time.perf_counter() - t0
    assert all(t[0].item() == float(i) for i, t in enumerate(tensors.values()))
    shutil.rmtree(root / "sync")

    for key, threads in (("stall_1thread_s", 1), ("stall_s", None)):
        asyn = CheckpointManager(str(root / f"async{key}"), keep=1, async_save=True, copy_threads=threads)
        asyn.save(1, state)     # warm-up: a first save allocates the host staging buffers
        asyn.wait()
        t0 = time.perf_counter()
        asyn.save(2, state)
        out[key] = time.perf_counter() - t0
        asyn.wait()
        if threads is None:
            out["async_total_s"] = time.perf_counter() - t0
            out["copy_threads"] = asyn.copy_threads
        asyn.close()
    shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 1000])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", help="where to write (default: a temporary directory on the disk of --out)")
    ap.add_argument("--out", default="results/checkpoint")
    args = ap.parse_args()

    import hpctrain

    hpctrain.init("local")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix=".ckpt-bench-", dir=out))
    rows = []
    try:
        for mb in args.sizes_mb:
            runs = []
            for r in range(args.repeats):
                print(f"[{mb} MB, repeat {r + 1}/{args.repeats}]", file=sys.stderr, flush=True)
                runs.append(measure(mb, base / "run"))
            row = {"mb": mb, "runs": runs}
            for key in runs[0]:
                row[key] = statistics.median(run[key] for run in runs)
            row["disk_gbps"] = row["bytes"] / row["disk_s"] / 1e9
            row["sync_gbps"] = row["bytes"] / row["sync_s"] / 1e9
            row["sync_vs_disk"] = statistics.median(run["disk_s"] / run["sync_s"] for run in runs)
            row["stall_vs_sync"] = statistics.median(run["stall_s"] / run["sync_s"] for run in runs)
            row["torch_save_vs_sync"] = statistics.median(run["torch_save_s"] / run["sync_s"] for run in runs)
            rows.append(row)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    write_outputs(rows, out, args)


def write_outputs(rows, out: Path, args) -> None:
    data = {"rows": rows, "repeats": args.repeats, "cores": CORES}
    lines = [f"Checkpoint of a state of float32 tensors, one process, medians of {args.repeats} repeats "
             "(seconds; GB/s = 10^9 bytes/s).  Ratios are medians of per-repeat ratios.\n",
             "| state | disk write+fsync | sync save | sync / disk bandwidth | async stall (copy threads) "
             "| stall / sync | stall, 1 thread | async total | restore | torch.save+fsync | torch.save / sync time |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mb']} MB | {r['disk_s']:.3f} s ({r['disk_gbps']:.2f} GB/s) | {r['sync_s']:.3f} s "
                     f"({r['sync_gbps']:.2f} GB/s) | {r['sync_vs_disk']:.0%} | {r['stall_s']:.3f} s "
                     f"({r['copy_threads']}) | {r['stall_vs_sync']:.1%} | {r['stall_1thread_s']:.3f} s | "
                     f"{r['async_total_s']:.3f} s | {r['restore_s']:.3f} s | "
                     f"{r['torch_save_s']:.3f} s | {r['torch_save_vs_sync']:.2f} |")
    table = "\n".join(lines)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        sizes = [r["mb"] for r in rows]
        for key, label in (("disk_s", "disk write+fsync"), ("sync_s", "hpctrain sync save"),
                           ("stall_s", "hpctrain async stall"), ("restore_s", "hpctrain restore"),
                           ("torch_save_s", "torch.save+fsync")):
            ax.plot(sizes, [r[key] for r in rows], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("state size (MB)")
        ax.set_ylabel("seconds")
        ax.legend()
        return fig

    write_results(out, "checkpoint", data, table, draw)


if __name__ == "__main__":
    main()
