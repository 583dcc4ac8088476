"""The one way hpctrain ends a whole job: print why, then MPI_Abort where MPI runs, else exit."""
from __future__ import annotations

import os
import sys

__all__ = ["abort_job"]


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
        mpi_mod.COMM_WORLD.Abort(code)
    os._exit(code)
