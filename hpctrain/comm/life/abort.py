"""The one way hpctrain ends a whole job: print why, then MPI_Abort where MPI runs, else exit."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["abort_job", "exit_after_failure", "fail_this_rank", "leave_with_the_others"]

_ABORT_GRACE_S = 10.0


def abort_job(message: str, code: int = 1) -> None:
    """Print ``message`` to stderr and end the whole job (never returns).

    Where MPI is initialised (the MPI backend, or Horovod over MPI in the same
    process) ``MPI_Abort`` ends every rank; elsewhere (a world of one,
    Horovod over Gloo) this process exits with ``code`` at once and the
    launcher ends the others.  Used by the stall watchdog, the uncaught
    exception hook, ``python -m hpctrain.run`` and every backend.
    """
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is not None and mpi_mod.Is_initialized() and not mpi_mod.Is_finalized():
        # MPI_Abort normally ends every rank at once; if it does not return (seen rarely after a
        # process failure under Open MPI's fault-tolerance extension), this process still ends.
        threading.Thread(target=lambda: (time.sleep(_ABORT_GRACE_S), os._exit(code)), daemon=True).start()
        mpi_mod.COMM_WORLD.Abort(code)
    os._exit(code)


def exit_after_failure(message: str, code: int = 1) -> None:
    """Print ``message`` and end this process with ``code`` (never returns): the way out once ranks have failed.

    Under Open MPI's fault-tolerance extension (ULFM) a survivor's ``MPI_Abort``
    after a remote rank failed ends the job with status 0 (seen with Open MPI
    5.0); a survivor's own exit with ``code`` is the job's status, and every
    other survivor then sees it failed too and ends the same way within a
    watchdog period (:mod:`hpctrain.comm.backends.mpi.failures`).
    """
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def leave_with_the_others() -> None:
    """Elastic mode: end this process at once, saying nothing, when every rank ends for the same error (one
    rank said it).  An exit would go unreported to the others, who would wait for this rank to finish (rank 0
    for the stall timeout, across nodes); a process that died is reported (see :func:`fail_this_rank`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):       # (a closed or broken stream: nothing more to say there)
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def fail_this_rank(message: str, rank="?") -> None:
    """Elastic mode: print ``message`` and end this process as a failed rank (never returns).

    The process kills itself (SIGKILL): Open MPI's fault-tolerance extension
    reports a process that died to the others (who then re-form without it,
    :mod:`hpctrain.elastic`), but not one that exited, even with an error
    status; they would wait for it for ever.
    """
    sys.stderr.write(f"{message.rstrip()}\nhpctrain: rank {rank} leaves the job as a failed rank; the others go on "
                     f"without it (elastic mode)\n")
    leave_with_the_others()
