"""Report versions, the detected launcher, the rank layout and which backends import (``hpctrain info``).

Importing is not working: ``hpctrain check`` (:mod:`hpctrain.check`) runs each backend.
"""
from __future__ import annotations

import importlib
import os
import sys
import platform
import socket
from typing import Dict, List, Tuple

from .env import detect_launcher
from .launch import find_mpirun, mpi_vendor

__all__ = ["versions", "backends", "report"]


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # any import failure is information here
        return f"not available ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"


def _mpi_library() -> str:
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # reading the version needs no MPI_Init
        from mpi4py import MPI

        return MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
    except Exception as exc:
        return f"not available ({exc})"


def _horovod() -> str:
    try:
        import horovod.torch as hvd
    except Exception as exc:
        return f"not available ({type(exc).__name__}: {exc})"
    import horovod

    ctrl = [n for n, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if ok]
    ops = [n for n, ok in (("NCCL", hvd.nccl_built()),) if ok]
    return f"{horovod.__version__} (frameworks: PyTorch; controllers: {', '.join(ctrl) or 'none'}" \
           f"{'; GPU ops: ' + ', '.join(ops) if ops else ''})"


def versions() -> List[Tuple[str, str]]:
    """Return (component, version) pairs for Python, MPI, mpi4py, numpy, torch, TensorFlow and Horovod."""
    mpirun = find_mpirun()
    return [
        ("python", platform.python_version()),
        ("MPI library", _mpi_library()),
        ("mpirun", f"{mpirun} ({mpi_vendor(mpirun)})" if mpirun else "not found"),
        ("mpi4py", _version("mpi4py")),
        ("numpy", _version("numpy")),
        ("torch", _version("torch")),
        ("tensorflow", _version("tensorflow")),
        ("horovod", _horovod()),
    ]


def backends(items: List[Tuple[str, str]]) -> Dict[str, str]:
    """Return which backends import, from the ``versions()`` items (``hpctrain check`` runs them)."""
    got = dict(items)
    ok = lambda v: not v.startswith("not available")  # noqa: E731
    return {
        "local": "importable",
        "mpi": "importable" if ok(got["mpi4py"]) and ok(got["MPI library"]) else "missing mpi4py/MPI",
        "horovod": "importable" if ok(got["horovod"]) else "missing (run scripts/install_horovod.sh)",
    }


def report() -> str:
    """Return the text printed by ``hpctrain info`` (rank 0 prints it; all ranks help fill the layout)."""
    from .world import init

    launch = detect_launcher()
    comm = init()
    layout = comm.allgather_object((comm.rank, socket.gethostname(), comm.topology.local_rank,
                                    comm.topology.node_rank))
    if comm.rank != 0:
        return ""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    items = versions()
    lines = ["hpctrain info", ""]
    width = max(len(k) for k, _ in items)
    lines += [f"  {k:<{width}}  {v}" for k, v in items]
    lines += ["", f"  launcher   {launch.launcher if launch else 'none (plain python: world of size 1)'}",
              f"  backend    {comm.backend} (world size {comm.size}, {comm.topology.num_nodes} node(s))", "",
              "  backends (imported only; `hpctrain check` runs them):"]
    lines += [f"    {k:<8} {v}" for k, v in backends(items).items()]
    lines += ["", "  rank  host                  local_rank  node"]
    lines += [f"  {r:>4}  {h:<20}  {lr:>10}  {nr:>4}" for r, h, lr, nr in layout]
    return "\n".join(lines + [""] + algorithm_lines(comm))


SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)


def algorithm_lines(comm) -> List[str]:
    """Return the registered all-reduce algorithms (those of this backend marked *) and what ``auto`` picks."""
    from .collectives import registry
    from .settings import format_bytes

    offered = set(comm.allreduce_algorithms())
    lines = ["  all-reduce algorithms (* runs on this backend):"]
    for a in registry.algorithms("allreduce"):
        backends = ", ".join(a.backends) if a.backends else "any backend"
        lines.append(f"    {'*' if a.name in offered else ' '} {a.name:<13} {backends:<13} {a.summary}")
    picks = ", ".join(f"{format_bytes(n)} -> {comm.allreduce_algorithm(n)}" for n in SIZES)
    return lines + [f"  auto picks here: {picks}"]
