"""Start and stop hpctrain in this process: choose the backend, hold the world communicator.

The world communicator is the one process-wide object (as ``MPI.COMM_WORLD``
is); sub-communicators from ``split`` are ordinary objects passed where they
are needed.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import traceback
from typing import Optional

from .. import settings
from ..agreement import check_writable, disagreeing_settings
from ..comm.life.abort import fail_this_rank as _fail_this_rank
from ..comm.base import Communicator
from ..comm.life.runtime import SHARED_SETTINGS, Config
from ..env import detect_launcher
from ..errors import NotInitializedError
from ..launcher_protocol import ELASTIC_FINISHED, ELASTIC_STARTED, write_world
from ..memory import keep_freed_memory
from .generation import generation, on_reform, on_reform_of, reformed

__all__ = ["init", "shutdown", "is_initialized", "world", "resolve_backend", "BACKENDS", "on_reform", "on_reform_of",
           "generation"]

BACKENDS = ("auto", "mpi", "horovod", "local")

_lock = threading.Lock()
_world: Optional[Communicator] = None
_saved_excepthook = None
_atexit_installed = False
_exit_status = [0]          # what sys.exit() was last called with, after init() (see _install_atexit)
_restarting = [False]       # this job ends for the elastic launcher's restart on more hosts (hpctrain.elastic.hosts)
_SAY_IT_S = 2.0             # how long other ranks wait before exiting on a bad setting, so rank 0's line is seen


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
    :mod:`hpctrain.comm.life.departures`; its ``sys.exit`` status becomes the
    job's).  It also sets glibc's allocator so that memory freed in one
    training step is reused by the next without page faults
    (:mod:`hpctrain.memory`; ``HPCTRAIN_KEEP_FREED_MEMORY=0`` leaves it).

    A bad ``HPCTRAIN_*`` value raises :class:`~hpctrain.settings.SettingError`
    on every rank (uncaught, it is one line on rank 0, no traceback); an
    ``HPCTRAIN_*`` name hpctrain does not know is a warning on rank 0 naming
    the closest one; an ``HPCTRAIN_TIMELINE`` file that rank 0 cannot write is
    a SettingError at once, not a lost trace at the end.
    """
    global _world
    with _lock:
        try:
            chosen = resolve_backend(backend)
            if _world is not None:
                if chosen != _world.backend:
                    raise ValueError(f"hpctrain is already initialised with the {_world.backend} backend; "
                                     f"call hpctrain.shutdown() before init(backend={chosen!r})")
                return _world
            settings.warn_unknown(rank_zero=_launcher_rank() == 0 and not settings.get("HPCTRAIN_LAUNCH_CHECKED"))
            config = Config.from_env()
        except settings.SettingError:
            _install_setting_error_hook()
            raise
        keep_freed_memory()
        if chosen == "mpi":
            from ..comm.backends import mpi as impl
        elif chosen == "horovod":
            from ..comm.backends import horovod as impl
        else:
            from ..comm.backends import local as impl
        w = impl.init_world(config)
        if w.size > 1:
            # settings that decide which algorithm runs and whether calls are checked: ranks that differ would
            # run different collectives (a hang, or a measured choice read as data), so they are an error here
            differ = disagreeing_settings(w.allgather_object_unchecked,
                                          {settings.setting("HPCTRAIN_" + f.upper()).name: getattr(config, f)
                                           for f in SHARED_SETTINGS})
            if differ:
                w.close()
                _install_setting_error_hook()
                raise settings.SettingError(f"ranks of {w.name} disagree on settings every rank must share "
                                            f"(set them alike for all ranks; a tuning file counts): {differ}")
        if config.timeline:       # every rank's timeline, merged into one file by rank 0 at shutdown
            from ..comm.recording.timeline import write_trace_at_close

            w.timeline.on = False          # (the check's own collective stays off the timeline)
            why = check_writable(w, config.timeline)
            w.timeline.on = True
            if why:
                w.close()
                _install_setting_error_hook()
                raise settings.SettingError(f"HPCTRAIN_TIMELINE={config.timeline!r}: {why}")
            write_trace_at_close(w, config.timeline, on_reform)      # (over each re-formed world too)
        _world = w
        reforms = w.life.failure_policy.reforms      # (elastic mode, as the policy chosen with the runtime says)
        joining = settings.get("HPCTRAIN_ELASTIC_JOINING")    # (spawned into a running world: it speaks for them)
        if reforms and w.rank == 0 and not joining:       # (hpctrain launch --elastic looks for it: run_elastic)
            sys.stdout.write(f"{ELASTIC_STARTED} {w.size} ranks; a failed rank leaves the others going on down to "
                             f"{settings.get('HPCTRAIN_ELASTIC_MIN_NP')}\n")
            sys.stdout.flush()
            if w.topology.num_nodes > 1 and han_may_run(os.environ):
                sys.stderr.write(f"hpctrain: warning: {HAN_NOT_FAULT_TOLERANT}\n")
            if w.topology.num_nodes > 1 and tcp_put_may_run(os.environ):
                sys.stderr.write(f"hpctrain: warning: {TCP_PUT_MAY_DEADLOCK}\n")
        if reforms and not joining:
            write_world(w)
        _install_excepthook(w)
        _install_atexit()       # (a world of one too: its timeline and on_close callbacks run at exit)
        return w


def _launcher_rank() -> int:
    """This process's rank as its launcher says (0 without one)."""
    launch = detect_launcher()
    return launch.rank if launch is not None else 0


def _install_setting_error_hook() -> None:
    """Print an uncaught SettingError as one line on rank 0 (none elsewhere) instead of a traceback per rank."""
    previous = sys.excepthook
    if getattr(previous, "hpctrain_settings", False):
        return

    def hook(kind, value, tb):
        if not issubclass(kind, settings.SettingError):
            return previous(kind, value, tb)
        if _launcher_rank() == 0:
            sys.stderr.write(f"hpctrain: error: {value}\n")
            sys.stderr.flush()
        else:      # (a launcher ends the job when the first rank exits: let rank 0 say why first)
            time.sleep(_SAY_IT_S)

    hook.hpctrain_settings = True
    sys.excepthook = hook


def _install_atexit() -> None:
    """Shut down at interpreter exit, so a rank that returns or exits early tells the others it left."""
    global _atexit_installed
    if not _atexit_installed:
        real_exit = sys.exit

        def exit(status=None):      # noqa: A001 - records the status, then is sys.exit
            _exit_status[0] = status
            real_exit(status)

        exit.__doc__ = real_exit.__doc__
        exit.__wrapped__ = real_exit
        sys.exit = exit
        atexit.register(_shutdown_at_exit)
        _atexit_installed = True


def _status_code(status) -> int:
    """The process exit status of ``sys.exit(status)``: None -> 0, an int -> itself, anything else -> 1."""
    return 0 if status is None else status if isinstance(status, int) else 1


def _shutdown_at_exit() -> None:
    """``shutdown()`` at interpreter exit; a failure there names its cause and ends the process with status 1.

    Python ignores an exception raised in an exit hook (the status stays 0), so
    a failed timeline or checkpoint flush would otherwise be a warning on one
    rank of a job that "succeeded".
    """
    code = _status_code(_exit_status[0])
    last = _world
    try:
        shutdown(_exit_status=code)
    except BaseException as exc:  # noqa: BLE001 - the process is ending: say why, and fail
        message = (f"hpctrain: rank {_launcher_rank()}: shutting down at exit failed ({type(exc).__name__}: "
                   f"{exc}); exiting with status {code or 1}\n")
        for stream, text in ((sys.stdout, ""), (sys.stderr, message)):
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):       # (a closed or broken stream: nothing more to say there)
                pass
        os._exit(code or 1)
    policy = last.life.failure_policy if last is not None else None
    if code == 0 and policy is not None and last.rank == 0 and policy.reforms and not _restarting[0]:
        behind = len(policy.left_behind)        # (failed ranks the job went on without: on_rank_failure)
        sys.stdout.write(f"{ELASTIC_FINISHED} with {last.size - behind} ranks after {generation()} re-forming"
                         f"{'' if generation() == 1 else 's'}{f', {behind} failed and left behind' if behind else ''}\n")
        sys.stdout.flush()
    if generation() or (policy is not None and policy.left_behind) or heartbeats_on():
        _exit_without_finalize(code)            # (ranks failed and the job went on, or finalize would not return)


def _mark_restarting() -> None:
    """This elastic job is ending for its launcher's restart on more hosts: rank 0 does not say it finished."""
    _restarting[0] = True


def fail_this_rank(message: str) -> None:
    """Elastic mode: print ``message`` and end this process as a failed rank (never returns; see
    :func:`hpctrain.comm.life.abort.fail_this_rank`)."""
    _fail_this_rank(message, _world.rank if _world is not None else "?")


HAN_NOT_FAULT_TOLERANT = ("Open MPI's han collectives may run across nodes (OMPI_MCA_coll does not leave them out), "
                          "and they are not fault tolerant: a rank failing inside a broadcast leaves the others "
                          "a wrong result and no error; start elastic jobs with `hpctrain launch --elastic` or add "
                          "`--mca coll ^han,cuda` to mpirun")


TCP_PUT_MAY_DEADLOCK = ("Open MPI's TCP transport may send large messages by its emulated put (OMPI_MCA_btl_tcp_flags "
                        "does not leave it out), and a put to a rank that dies can deadlock a survivor inside the "
                        "library; start elastic jobs with `hpctrain launch --elastic` or add `--mca btl_tcp_flags "
                        "send,inplace,need-ack,need-csum` to mpirun")


def tcp_put_may_run(env) -> bool:
    """Whether Open MPI's TCP transport may use its emulated put: OMPI_MCA_btl_tcp_flags is unset or names put."""
    flags = env.get("OMPI_MCA_btl_tcp_flags", "").replace(" ", "")
    return not flags or "put" in flags.split(",") or (flags.isdigit() and bool(int(flags) & 0x2))


def han_may_run(env) -> bool:
    """Whether Open MPI may pick its han collectives (its default across nodes): OMPI_MCA_coll does not leave them
    out.  (`hpctrain launch --elastic` does: :func:`hpctrain.launcher.launch.build_command`.)"""
    coll = env.get("OMPI_MCA_coll", "").replace(" ", "")
    if not coll:
        return True
    names = coll.lstrip("^").split(",")
    return "han" not in names if coll.startswith("^") else "han" in names


def heartbeats_on() -> bool:
    """Whether Open MPI's own heartbeat failure detector runs in this process (``--mca mpi_ft_detector true``, a
    user's choice; hpctrain's heartbeat is another: :mod:`hpctrain.comm.backends.mpi.heartbeat`): with it, Open
    MPI 5.0's ``MPI_Finalize`` does not return."""
    return os.environ.get("OMPI_MCA_mpi_ft_detector", "").strip().lower() in ("1", "true", "yes", "on")


def _exit_without_finalize(code: int) -> None:
    """End the process now, without ``MPI_Finalize``: after a re-forming (elastic mode), or when the job went on
    without failed ranks (``on_rank_failure``), Open MPI's finalize waits for the processes that were lost when
    they ran on another node, for ever."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _install_excepthook(comm: Communicator, previous=None) -> None:
    """Make an uncaught exception print its traceback and abort every rank.

    A :class:`~hpctrain.settings.SettingError`, a :class:`~hpctrain.errors.CheckpointError` or the call
    check's :class:`~hpctrain.errors.CollectiveMismatchError` is the exception (``every_rank``): hpctrain
    raises it on every rank alike, so it is one line on rank 0 and the ranks leave together (exit status 1;
    in elastic mode each ends at once, as an exit there would go unreported) instead of a traceback and an
    abort per rank.  A
    KeyboardInterrupt (Ctrl-C) makes rank 0 say what survives it (the
    ``on_interrupt`` notes: which checkpoint is committed); a world of one first
    shuts down, which commits a save in flight.  In a world of one nothing is
    aborted: the exception ends the process as Python would.  In elastic mode
    (``HPCTRAIN_ELASTIC``) an uncaught exception ends only its own process,
    which the other ranks see as a failed rank (:mod:`hpctrain.elastic`).
    """
    global _saved_excepthook
    previous = _saved_excepthook = sys.excepthook if previous is None else previous

    def hook(kind, value, tb):
        if getattr(value, "every_rank", False):        # (a SettingError, a CheckpointError, a mismatch: alike)
            if comm.rank == 0:
                sys.stderr.write(f"hpctrain: error: {value}\n")
                sys.stderr.flush()
            if comm.life.failure_policy.reforms:        # (an exit goes unreported in elastic mode: see there)
                from ..comm.life.abort import leave_with_the_others

                leave_with_the_others()
            return
        if issubclass(kind, KeyboardInterrupt):
            _say_what_survives(comm)
            if comm.backend == "local":
                return previous(kind, value, tb)
            comm.abort(f"hpctrain: rank {comm.rank}: interrupted (KeyboardInterrupt), aborting the job", 130)
        if comm.backend == "local":
            return previous(kind, value, tb)
        text = "".join(traceback.format_exception(kind, value, tb))
        status = getattr(value, "exit_status", 1)       # (a rank that exited with status N: the job's too)
        comm.life.failure_policy.end_after(comm.rank, text, "", value, status if isinstance(status, int) and status > 0
                                      else 1)

    sys.excepthook = hook


def _say_what_survives(comm: Communicator) -> None:
    """Rank 0: print the ``on_interrupt`` notes (a world of one shuts down first, committing what it can)."""
    notes = comm.life.interrupt_notes()
    if comm.backend == "local":
        try:
            shutdown()
        except Exception as exc:  # noqa: BLE001 - said, and the interruption goes on
            sys.stderr.write(f"hpctrain: shutting down after the interruption failed: {exc}\n")
    if comm.rank != 0:
        return
    for note in notes:
        try:
            sys.stderr.write(f"hpctrain: interrupted: {note()}\n")
        except Exception:  # noqa: BLE001 - a note must not hide the interruption
            pass
    sys.stderr.flush()


def shutdown(_exit_status: int = 0) -> None:
    """Finish queued collectives and release hpctrain; ``init()`` may be called again.

    Runs what was registered with ``world().on_close`` (timeline, metrics,
    checkpoint flushes), then leaves with the other ranks.  If any of those
    fails, the rest still run and this rank still leaves; then
    :class:`~hpctrain.errors.ShutdownError` names every failure.  The world is
    released either way.
    """
    global _world, _saved_excepthook
    with _lock:
        if _world is None:
            return
        w, _world = _world, None
        if _saved_excepthook is not None:
            sys.excepthook = _saved_excepthook
            _saved_excepthook = None
        w.close(_exit_status)


def exit_status() -> int:
    """The status of the ``sys.exit()`` this process is in, as recorded since ``init()`` (0 if none)."""
    return _status_code(_exit_status[0])


def is_initialized() -> bool:
    """Return True between ``init()`` and ``shutdown()``."""
    return _world is not None


def world() -> Communicator:
    """Return the world communicator; raise NotInitializedError before ``init()``."""
    if _world is None:
        raise NotInitializedError("hpctrain is not initialised: call hpctrain.init() first")
    return _world


def _replace_world(new: Communicator) -> None:
    """Make ``new`` the world (the survivors' one, :func:`hpctrain.elastic.reform`) and run the re-form hooks."""
    global _world
    with _lock:
        if _world is None:
            raise NotInitializedError("hpctrain is not initialised: there is no world to re-form")
        _world = new
        _install_excepthook(new, previous=_saved_excepthook)
    write_world(new)
    reformed(new)


def comm_or_world(comm: Optional[Communicator]) -> Communicator:
    """Return ``comm``, or the world communicator when it is None (the default of every adapter)."""
    return world() if comm is None else comm
