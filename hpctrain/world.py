"""Start and stop hpctrain in this process: choose the backend, hold the world communicator.

The world communicator is the one process-wide object (as ``MPI.COMM_WORLD``
is); sub-communicators from ``split`` are ordinary objects passed where they
are needed.
"""
from __future__ import annotations

import atexit
import sys
import threading
import traceback
from typing import Optional

from . import settings
from .comm.base import Communicator
from .comm.runtime import Config
from .env import detect_launcher
from .errors import NotInitializedError
from .memory import keep_freed_memory

__all__ = ["init", "shutdown", "is_initialized", "world", "resolve_backend", "BACKENDS"]

BACKENDS = ("auto", "mpi", "horovod", "local")

_lock = threading.Lock()
_world: Optional[Communicator] = None
_saved_excepthook = None
_atexit_installed = False


def resolve_backend(backend: str = "auto") -> str:
    """Return the concrete backend for ``backend``.

    ``"auto"`` honours HPCTRAIN_BACKEND, then picks "mpi" under an MPI launcher
    (mpirun/mpiexec of OpenMPI or MPICH, srun), "horovod" under ``horovodrun
    --gloo`` (no MPI launcher variables), and "local" without a launcher.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = settings.get("HPCTRAIN_BACKEND")
    if backend != "auto":
        return backend
    launch = detect_launcher()
    if launch is None:
        return "local"
    return "horovod" if launch.launcher == "horovod-gloo" else "mpi"


def init(backend: str = "auto") -> Communicator:
    """Initialise hpctrain and return the world communicator (idempotent).

    Args:
        backend: "auto", "mpi", "horovod" or "local" (see :func:`resolve_backend`).

    With the MPI and Horovod backends, an uncaught exception on any rank
    aborts the whole job instead of leaving the others waiting, and a rank
    that leaves (returns, exits or calls :func:`shutdown`) while others still
    call collectives makes them fail within seconds, naming it (see
    :mod:`hpctrain.comm.departures`).  It also sets glibc's allocator so that
    memory freed in one training step is reused by the next without page
    faults (:mod:`hpctrain.memory`; ``HPCTRAIN_KEEP_FREED_MEMORY=0`` leaves it).
    """
    global _world
    with _lock:
        chosen = resolve_backend(backend)
        if _world is not None:
            if chosen != _world.backend:
                raise ValueError(f"hpctrain is already initialised with the {_world.backend} backend; "
                                 f"call hpctrain.shutdown() before init(backend={chosen!r})")
            return _world
        config = Config.from_env()
        keep_freed_memory()
        if chosen == "mpi":
            from .comm import mpi as impl
        elif chosen == "horovod":
            from .comm import horovod as impl
        else:
            from .comm import local as impl
        _world = impl.init_world(config)
        if config.timeline:       # every rank's timeline, merged into one file by rank 0 at shutdown
            from .comm.timeline import write_trace
            w = _world
            w._rt.before_close.append(lambda: write_trace(w, config.timeline))
        if _world.backend != "local":
            _install_excepthook(_world)
        if _world.backend != "local" or config.timeline:   # (a world of one writes its timeline at exit too)
            _install_atexit()
        return _world


def _install_atexit() -> None:
    """Shut down at interpreter exit, so a rank that returns or exits early tells the others it left."""
    global _atexit_installed
    if not _atexit_installed:
        atexit.register(shutdown)
        _atexit_installed = True


def _install_excepthook(comm: Communicator) -> None:
    """Make an uncaught exception print its traceback and abort every rank."""
    global _saved_excepthook
    _saved_excepthook = sys.excepthook
    def hook(kind, value, tb):
        text = "".join(traceback.format_exception(kind, value, tb))
        comm.abort(f"hpctrain: rank {comm.rank}: uncaught exception, aborting the job:\n{text}")

    sys.excepthook = hook


def shutdown() -> None:
    """Finish queued collectives and release hpctrain; ``init()`` may be called again."""
    global _world, _saved_excepthook
    with _lock:
        if _world is None:
            return
        _world.close()
        _world = None
        if _saved_excepthook is not None:
            sys.excepthook = _saved_excepthook
            _saved_excepthook = None


def is_initialized() -> bool:
    """Return True between ``init()`` and ``shutdown()``."""
    return _world is not None


def world() -> Communicator:
    """Return the world communicator; raise NotInitializedError before ``init()``."""
    if _world is None:
        raise NotInitializedError("hpctrain is not initialised: call hpctrain.init() first")
    return _world


def comm_or_world(comm: Optional[Communicator]) -> Communicator:
    """Return ``comm``, or the world communicator when it is None (the default of every adapter)."""
    return world() if comm is None else comm
