"""Making an MPI world: MPI initialised and the launcher checked, the world's runtime, its backend."""
from __future__ import annotations

import os

from .... import settings
from ....env import detect_launcher
from ....errors import BackendUnavailableError
from ...base import Communicator
from ...life.abort import abort_job, fail_this_rank
from ...life.departures import Departures
from ...life.runtime import Config, Runtime
from ..notices import MPINotices
from .communicator import MPIBackend
from .failures import FailureDetector
from .heartbeat import Heartbeat, node_keys
from .requests import failure_classes

__all__ = ["init_world", "world_over"]


def init_world(config: Config) -> Communicator:
    """Initialise MPI (if needed) and return the world communicator.

    Raises BackendUnavailableError when mpi4py is missing or when the launcher
    started N tasks but MPI sees a world of size 1 (a launcher/MPI mismatch,
    e.g. ``srun --mpi=pmi2`` with OpenMPI 5, that would otherwise run N
    independent copies of the job).
    """
    # Open MPI's UCX one-sided component prints an error on machines without UCX transports when a
    # shared window is created; the shared-memory algorithms only need osc/sm. A user setting wins.
    os.environ.setdefault("OMPI_MCA_osc", "^ucx")
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise BackendUnavailableError(f"the MPI backend needs mpi4py: {exc}") from exc
    if not MPI.Is_initialized():  # mpi4py.rc.initialize may have been turned off
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    world = MPI.COMM_WORLD
    launch = detect_launcher()
    if launch is not None and launch.size > 1 and world.Get_size() == 1:
        raise BackendUnavailableError(
            f"the launcher ({launch.launcher}) started {launch.size} tasks but MPI sees a world of size 1 "
            f"in each: the MPI library does not speak this launcher's protocol (e.g. srun --mpi=pmi2 with "
            f"OpenMPI 5; use srun --mpi=pmix or mpirun). Refusing to run {launch.size} independent copies.")

    return world_over(world, config, "world", owns=False)


def world_over(comm, config: Config, name: str = "world", owns: bool = True) -> Communicator:
    """A world communicator over the MPI communicator ``comm`` (``MPI.COMM_WORLD``, or the survivors' one
    after a failure: :mod:`hpctrain.elastic`), with its own runtime (lanes, watchdog, departures, failures).

    Collective over ``comm``.
    """
    from mpi4py import MPI

    codes = failure_classes(MPI)
    departures = failures = None
    if comm.Get_size() > 1:
        notices = MPINotices(comm, MPI)
        departures = Departures(notices.rank, notices.size, notices.poll, notices.announce, notices.free)
        hosts = comm.allgather(MPI.Get_processor_name())
        failures = FailureDetector(comm, hosts, MPI, _heartbeat(comm, hosts, config, MPI))
    runtime = Runtime(config, comm.Get_rank(), abort_job, departures, failures,
                      is_failure=lambda exc: isinstance(exc, MPI.Exception) and exc.Get_error_class() in codes)
    try:
        return Communicator(MPIBackend(runtime, comm, name, range(comm.Get_size()), owns=owns))
    except BaseException:
        runtime.discard()       # (its watchdog must not outlive a world that was never made)
        raise


def _heartbeat(comm, hosts, config: Config, MPI):
    """The world's heartbeat (elastic mode, ranks on several nodes, HPCTRAIN_ELASTIC_SILENT_S > 0), or None.

    Collective over ``comm`` in elastic mode across nodes: one all-gather, so that every rank decides alike
    (rank 0's HPCTRAIN_ELASTIC_SILENT_S counts, and a rank whose library cannot declare failures turns the
    heartbeat off for all, with one warning).
    """
    from .ulfm import Declarer, available

    nodes = node_keys(hosts, settings.get("HPCTRAIN_RANKS_PER_NODE"))
    if not config.elastic or len(set(nodes)) < 2:
        return None
    # (only where ULFM runs: declaring a failure to a library started without it would end the job)
    declarer = Declarer.load(MPI.COMM_WORLD.Get_rank()) if available(comm, MPI) else None
    views = comm.allgather((settings.get("HPCTRAIN_ELASTIC_SILENT_S"), declarer is not None))
    silent, rank = views[0][0], comm.Get_rank()
    if not silent:
        return None
    if not all(ok for _, ok in views):
        if rank == 0:
            import warnings

            lacking = [r for r, (_, ok) in enumerate(views) if not ok]
            warnings.warn(f"hpctrain: the heartbeat across nodes (HPCTRAIN_ELASTIC_SILENT_S) needs Open MPI 5 with "
                          f"its fault-tolerance extension (ULFM), which ranks {lacking} lack; it is off, and a node "
                          f"that goes silent stalls the job until HPCTRAIN_STALL_TIMEOUT_S", RuntimeWarning,
                          stacklevel=2)
        return None
    return Heartbeat(comm, nodes, silent, declarer, lambda message: fail_this_rank(message, rank))
