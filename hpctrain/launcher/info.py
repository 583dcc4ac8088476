"""Report versions, the detected launcher, the rank layout and which backends are there (``hpctrain info``).

By default nothing heavy is imported: package versions come from the
installed distributions' metadata (``importlib.metadata``), Horovod's
framework extensions from the files it installed, so ``hpctrain info`` takes
well under two seconds where importing torch and TensorFlow takes several.
``hpctrain info --import`` imports each framework instead and reports its
import error, and Horovod's controllers (MPI, Gloo) and GPU ops.  Importing
is not working: ``hpctrain check`` (:mod:`hpctrain.launcher.check`) runs each backend.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import platform
import socket
from pathlib import Path
from typing import Dict, List, Tuple

from ..env import detect_launcher
from .launch import find_mpirun, mpi_vendor

__all__ = ["versions", "backends", "report"]

_MISSING = "not available"


@functools.lru_cache(maxsize=1)
def _distributions() -> Dict[str, List[str]]:
    """Top-level module -> the distributions that provide it (one scan of the installed metadata)."""
    return importlib.metadata.packages_distributions()


def _version(module: str, imports: bool) -> str:
    """The version of ``module``: from its distribution's metadata, or by importing it when ``imports``."""
    if not imports:         # the distribution may have another name (tensorflow-cpu provides tensorflow)
        for dist in _distributions().get(module, [module]):
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                pass
        return f"{_MISSING} (not installed)"
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as exc:  # any import failure is information here
        return f"{_MISSING} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"


def _mpi_library() -> str:
    try:
        import mpi4py

        if "mpi4py.MPI" not in sys.modules:
            mpi4py.rc.initialize = False  # reading the version needs no MPI_Init
        from mpi4py import MPI

        return MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()
    except Exception as exc:
        return f"{_MISSING} ({exc})"


def _horovod(imports: bool) -> str:
    if not imports:
        version = _version("horovod", False)
        if version.startswith(_MISSING):
            return version
        spec = importlib.util.find_spec("horovod")
        root = Path(next(iter(spec.submodule_search_locations or []), "")) if spec else Path()
        built = [name for name, sub in (("PyTorch", "torch"), ("TensorFlow", "tensorflow"))
                 if any((root / sub).glob("mpi_lib*.so"))]
        return f"{version} (framework ops built: {', '.join(built) or 'none'}; controllers: " \
               f"`hpctrain info --import`)"
    try:
        import horovod.torch as hvd
    except Exception as exc:
        return f"{_MISSING} ({type(exc).__name__}: {exc})"
    import horovod

    ctrl = [n for n, ok in (("MPI", hvd.mpi_built()), ("Gloo", hvd.gloo_built())) if ok]
    ops = [n for n, ok in (("NCCL", hvd.nccl_built()),) if ok]
    return f"{horovod.__version__} (frameworks: PyTorch; controllers: {', '.join(ctrl) or 'none'}" \
           f"{'; GPU ops: ' + ', '.join(ops) if ops else ''})"


def versions(imports: bool = False) -> List[Tuple[str, str]]:
    """Return (component, version) pairs for Python, MPI, mpi4py, numpy, torch, TensorFlow and Horovod.

    ``imports``: import each framework (slow; shows import errors) instead of
    reading the installed versions.
    """
    mpirun = find_mpirun()
    return [
        ("python", platform.python_version()),
        ("MPI library", _mpi_library()),
        ("mpirun", f"{mpirun} ({mpi_vendor(mpirun)})" if mpirun else "not found"),
        ("mpi4py", _version("mpi4py", imports)),
        ("numpy", _version("numpy", imports)),
        ("torch", _version("torch", imports)),
        ("tensorflow", _version("tensorflow", imports)),
        ("horovod", _horovod(imports)),
    ]


def backends(items: List[Tuple[str, str]], imports: bool = False) -> Dict[str, str]:
    """Return which backends are there, from the ``versions()`` items (``hpctrain check`` runs them)."""
    got = dict(items)
    ok = lambda v: not v.startswith(_MISSING)  # noqa: E731
    there = "importable" if imports else "installed"
    return {
        "local": there,
        "mpi": there if ok(got["mpi4py"]) and ok(got["MPI library"]) else "missing mpi4py/MPI",
        "horovod": there if ok(got["horovod"]) else "missing (run scripts/install_horovod.sh)",
    }


def report(imports: bool = False) -> str:
    """Return the text printed by ``hpctrain info`` (rank 0 prints it; all ranks help fill the layout).

    ``imports``: see :func:`versions`.
    """
    from ..world import init

    launch = detect_launcher()
    comm = init()
    layout = comm.allgather_object((comm.rank, socket.gethostname(), comm.topology.local_rank,
                                    comm.topology.node_rank))
    if comm.rank != 0:
        return ""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    items = versions(imports)
    from .. import __version__
    lines = [f"hpctrain info (hpctrain {__version__})", ""]
    width = max(len(k) for k, _ in items)
    lines += [f"  {k:<{width}}  {v}" for k, v in items]
    lines += ["", f"  launcher   {launch.launcher if launch else 'none (plain python: world of size 1)'}",
              f"  backend    {comm.backend} (world size {comm.size}, {comm.topology.num_nodes} node(s))", "",
              f"  backends ({'imported' if imports else 'installed'} only; `hpctrain check` runs them):"]
    lines += [f"    {k:<8} {v}" for k, v in backends(items, imports).items()]
    lines += ["", "  rank  host                  local_rank  node"]
    lines += [f"  {r:>4}  {h:<20}  {lr:>10}  {nr:>4}" for r, h, lr, nr in layout]
    return "\n".join(lines + [""] + algorithm_lines(comm))


SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)


def algorithm_lines(comm) -> List[str]:
    """Return the registered all-reduce algorithms (those of this backend marked *) and what ``auto`` picks."""
    from ..collectives import registry
    from ..settings import format_bytes

    offered = set(comm.allreduce_algorithms())
    lines = ["  all-reduce algorithms (* runs on this backend):"]
    for a in registry.algorithms("allreduce"):
        backends = ", ".join(a.backends) if a.backends else "any backend"
        lines.append(f"    {'*' if a.name in offered else ' '} {a.name:<13} {backends:<13} {a.summary}")
    picks = ", ".join(f"{format_bytes(n)} -> {comm.allreduce_algorithm(n)}" for n in SIZES)
    return lines + [f"  auto picks here: {picks}"]
