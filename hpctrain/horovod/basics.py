"""Horovod's framework-neutral API on hpctrain: init, ranks, build queries, ops, process sets, timeline.

``hpctrain.horovod.torch`` and ``hpctrain.horovod.tensorflow`` re-export
these names; they convert tensors and call :func:`submit`.  Everything runs
on hpctrain's own core (MPI through mpi4py, or hpctrain's Horovod backend
under ``horovodrun --gloo``); the ``horovod`` package is never imported here.

Horovod keeps one process-wide state (``hvd.init()``); so does this module,
holding the world communicator's negotiation thread
(:class:`hpctrain.horovod.controller.Controller`) and the process sets.
``shutdown()`` stops that thread but leaves hpctrain's world running, so
``init()`` may follow again (as with Horovod's Gloo controller).
"""
from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any, List, Optional

from .. import settings
from ..agreement import check_writable, writable
from ..hooks import Hooks
from ..world import init as _hpctrain_init
from .controller import Controller
from .pending import HorovodInternalError, OpHandle
from .timeline import Timeline

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
           "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
           "stop_timeline", "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet",
           "global_process_set", "add_process_set", "remove_process_set", "HorovodInternalError",
           "HostsUpdatedInterrupt", "submit", "root_details", "op_name", "controller", "PUBLIC"]
PUBLIC = __all__[:__all__.index("submit")]       # what every framework module re-exports from here

# Horovod's reduction ops (the same integer values as Horovod's).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "avg", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max", Product: "prod"}


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic-mode signal that hosts changed: ``hvd.elastic.run`` resets, and syncs the state
    again unless ``skip_sync`` (hosts were only removed: the ranks that remain hold the same state)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the job's hosts changed" + (" (hosts removed only)" if skip_sync else ""))
        self.skip_sync = skip_sync


reset_hooks = Hooks("reset")     # run after hvd.elastic re-initialised on a new world (see on_reset)


def on_reset(callback, owner=None):
    """Run ``callback()`` each time ``hvd.elastic.run`` has re-initialised Horovod on a re-formed world, before
    the state's reset callbacks (what holds the old negotiation, a DistributedOptimizer's buckets, rebuilds
    there: every rank runs them in the same order, so collectives inside meet).  With an ``owner``, held
    weakly, it is ``callback(owner)`` until the owner is dropped.  Returns a function that takes it back."""
    return reset_hooks.add(callback, owner)


class ProcessSet:
    """A subset of the world's ranks that run collectives together (``process_set=`` of every op).

    Args:
        ranks: the world ranks, or an mpi4py communicator whose ranks form the set.

    Register it with :func:`add_process_set` (on every rank) or pass it to
    ``init(process_sets=[...])``; ``process_set_id`` is set then.
    """

    def __init__(self, ranks: Any):
        if hasattr(ranks, "Get_group"):          # an mpi4py communicator
            from mpi4py import MPI
            group = ranks.Get_group()
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), MPI.COMM_WORLD.Get_group())
        self.ranks: List[int] = sorted(set(int(r) for r in ranks)) if ranks is not None else []
        self.process_set_id: Optional[int] = None

    def size(self) -> Optional[int]:
        """Return the number of ranks in the set (None before it is registered)."""
        return len(self.ranks) if self.process_set_id is not None else None

    def rank(self) -> Optional[int]:
        """Return this process's rank within the set (None when registered but not a member)."""
        if self.process_set_id is None:
            return None
        me = rank()
        return self.ranks.index(me) if me in self.ranks else None

    def included(self) -> Optional[bool]:
        """Return whether this process belongs to the set (None before it is registered)."""
        return None if self.process_set_id is None else rank() in self.ranks

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and (self.process_set_id, self.ranks) == (other.process_set_id,
                                                                                        other.ranks)

    def __hash__(self) -> int:
        return hash((self.process_set_id, tuple(self.ranks)))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet(None)
global_process_set.process_set_id = 0

_lock = threading.Lock()
_state = {"controller": None, "world": None, "homogeneous": True, "timeline": None, "forget_close": None}


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start Horovod's API on hpctrain (idempotent).

    Args:
        comm: None, or a list of all world ranks / an mpi4py communicator of
            the whole world (running on a subset of the world is refused: use
            a process set).
        process_sets: ProcessSet objects to register now, or "dynamic" (sets
            can always be added later here).
    """
    with _lock:
        if _state["controller"] is not None:
            return
        world = _hpctrain_init()
        if world.life.failure_policy.reforms:        # (what horovodrun's elastic workers read: the rank they started as)
            os.environ.setdefault("HOROVOD_RANK", str(world.rank))
            from ..launcher_protocol import rank_host

            os.environ.setdefault("HOROVOD_HOSTNAME", rank_host())
        if comm is not None:
            count = comm.Get_size() if hasattr(comm, "Get_size") else len(list(comm))
            if count != world.size:
                raise ValueError(f"hvd.init(comm=...) with {count} of the {world.size} ranks is not supported: "
                                 f"init on every rank and pass the subset as a ProcessSet")
        _state["homogeneous"] = len(set(world.allgather_object(world.topology.local_size))) == 1
        global_process_set.ranks = list(range(world.size))
        path = settings.get("HOROVOD_TIMELINE")
        if path and path != "DYNAMIC":
            why = check_writable(world, path)
            if why:
                raise settings.SettingError(f"HOROVOD_TIMELINE={path!r}: {why}")
        timeline = Timeline(path if world.rank == 0 else None) if path and path != "DYNAMIC" else None
        _state["timeline"] = timeline
        _state["world"] = world
        _state["controller"] = Controller(world, {0: (tuple(range(world.size)), world)}, timeline)
        # at hpctrain's shutdown (or exit), before it: a failure to write the timeline is reported like its own
        _state["forget_close"] = world.on_close(_shutdown_leaving, "hpctrain.horovod's shutdown (HOROVOD_TIMELINE)")
    if isinstance(process_sets, (list, tuple)):
        for ps in process_sets:
            add_process_set(ps)


def _shutdown_leaving() -> None:
    """``shutdown()`` as hpctrain's world closes: the other ranks' open requests fail saying this rank left."""
    from ..world import exit_status

    ctl = _state["controller"]
    status = exit_status()
    how = f"exited with status {status}" if status else "returned, exited or called hpctrain.shutdown()"
    shutdown(f"rank {ctl.rank} left the job ({how})" if ctl is not None else "", status)


def shutdown(_reason: str = "", _exit_status: int = 0) -> None:
    """Stop the negotiation thread on every rank (open requests fail); hpctrain's world keeps running."""
    with _lock:
        ctl, _state["controller"] = _state["controller"], None
        timeline, _state["timeline"] = _state["timeline"], None
        forget, _state["forget_close"] = _state["forget_close"], None
    if forget is not None:
        forget()
    if ctl is not None:
        ctl.stop(_reason, _exit_status)
        for ps in list(ctl.sets):
            if ps != 0:
                ctl.remove_set(ps)
    if timeline is not None:
        timeline.close()


def is_initialized() -> bool:
    """Return whether :func:`init` ran (and :func:`shutdown` did not since)."""
    return _state["controller"] is not None


def controller() -> Controller:
    """Return the running controller; ValueError (as Horovod) before ``init()``."""
    ctl = _state["controller"]
    if ctl is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return ctl


def _world():
    return controller().world


def rank() -> int:
    """Return this process's rank in the world."""
    return _world().rank


def size() -> int:
    """Return the number of ranks."""
    return _world().size


def local_rank() -> int:
    """Return this process's rank among the ranks of its node."""
    return _world().topology.local_rank


def local_size() -> int:
    """Return the number of ranks on this process's node."""
    return _world().topology.local_size


def cross_rank() -> int:
    """Return the index of this process's node."""
    return _world().topology.node_rank


def cross_size() -> int:
    """Return the number of nodes."""
    return _world().topology.num_nodes


def is_homogeneous() -> bool:
    """Return whether every node runs the same number of ranks."""
    controller()
    return _state["homogeneous"]


def mpi_threads_supported() -> bool:
    """Return whether MPI runs with MPI_THREAD_MULTIPLE (False off the MPI backend)."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Return whether collectives run over MPI (hpctrain's MPI backend)."""
    return _world().backend == "mpi"


def mpi_built() -> bool:
    """Return whether MPI is available to hpctrain (mpi4py importable)."""
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """Return whether collectives run over Gloo (hpctrain's Horovod backend under ``horovodrun --gloo``)."""
    return _world().backend == "horovod"


def gloo_built() -> bool:
    """Return whether Gloo is available (through an installed Horovod; hpctrain has no Gloo of its own)."""
    try:
        from horovod.common.util import gloo_built as real
    except ImportError:
        return False
    return bool(real())


def nccl_built() -> int:
    """Return 0: hpctrain.horovod moves CUDA tensors through host memory, never NCCL."""
    return 0


def ddl_built() -> bool:
    """Return False (no IBM DDL)."""
    return False


def ccl_built() -> bool:
    """Return False (no oneCCL)."""
    return False


def cuda_built() -> bool:
    """Return False: no CUDA kernels are built (CUDA tensors are staged through host memory)."""
    return False


def rocm_built() -> bool:
    """Return False (no ROCm kernels)."""
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording a timeline to ``file_path`` (rank 0 writes it; see :mod:`hpctrain.horovod.timeline`)."""
    ctl = controller()
    why = writable(file_path) if ctl.rank == 0 else ""
    if why:
        raise ValueError(f"hvd.start_timeline({file_path!r}): rank 0 {why}")
    old = ctl.timeline
    ctl.timeline = Timeline(file_path if ctl.rank == 0 else None, mark_cycles)
    _state["timeline"] = ctl.timeline
    if old is not None:
        old.close()


def stop_timeline() -> None:
    """Stop recording and write the timeline file."""
    ctl = controller()
    old, ctl.timeline = ctl.timeline, None
    _state["timeline"] = None
    if old is not None:
        old.close()


def op_name(op: Optional[int], average: Optional[bool] = None) -> str:
    """Return hpctrain's op name for Horovod's ``op``/``average`` pair (default: Average)."""
    if op is not None and average is not None:
        raise ValueError("pass op= or the deprecated average=, not both")
    if average is not None:
        op = Average if average else Sum
    if op is None:
        op = Average
    if op not in _OP_NAMES:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Adasum, Min, Max or Product")
    return _OP_NAMES[op]



def _set_id(process_set: Optional[ProcessSet]) -> int:
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"process_set must be a hvd.ProcessSet, got {type(ps).__name__}")
    if ps.process_set_id is None:
        raise ValueError(f"{ps} is not registered: call hvd.add_process_set() on every rank first")
    return ps.process_set_id


def root_details(root_rank: Any, process_set: Optional[ProcessSet]) -> tuple:
    """Return ``(root index in the set,)`` for a world rank ``root_rank``, or the invalid-argument marker.

    Horovod's ``root_rank`` is a world rank, also with a process set (it must be a member).
    """
    ps = global_process_set if process_set is None else process_set
    members = ps.ranks if ps.process_set_id else list(range(size()))
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) and not hasattr(root_rank, "__index__"):
        return ("invalid", f"root_rank must be an int, got {type(root_rank).__name__}")
    if int(root_rank) not in members:
        return ("invalid", f"root_rank {root_rank} is not a rank of the process set (ranks {members})")
    return (members.index(int(root_rank)),)


def submit(kind: str, name: Optional[str], process_set: Optional[ProcessSet], details: tuple,
           payload: Any, labels: tuple = ()) -> OpHandle:
    """Start a negotiated request on ``process_set`` (default: the world); see :mod:`hpctrain.horovod.controller`.

    ``labels``: the timeline's rows for it, as ``(row, kind)`` (default: the request's own name and kind).
    """
    ps = _set_id(process_set)
    return controller().submit(name, kind, ps, (kind, ps, details), payload, labels)


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of ranks) on every rank; return it with its id.

    Collective over the world: every rank calls it with the same ranks.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    n = size()
    bad = [r for r in ps.ranks if not 0 <= r < n]
    details = (tuple(ps.ranks),) if ps.ranks and not bad else (
        "invalid", f"a process set needs ranks of the world (0..{n - 1}), got {ps.ranks}")
    ps.process_set_id = submit("add_process_set", None, global_process_set, details, None).wait()
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` on every rank (collective); return whether it was registered."""
    if process_set is global_process_set or process_set.process_set_id in (None, 0):
        return False
    ctl = controller()
    if process_set.process_set_id not in ctl.sets:
        return False
    submit("remove_process_set", None, global_process_set, (process_set.process_set_id,), None).wait()
    process_set.process_set_id = None
    return True
