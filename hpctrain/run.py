"""Run a Python script so that an uncaught exception on any rank ends the whole job.

Usage: ``python -m hpctrain.run script.py [args...]`` (``hpctrain launch``
adds it for ``.py`` scripts).  Like ``python -m mpi4py``: the script runs as
``__main__``; if it raises, the traceback is printed with the rank and, when
MPI is running, ``MPI_Abort`` ends every rank instead of leaving the others
waiting in their next collective.  In elastic mode only the failing process
ends, and the others re-form without it (:mod:`hpctrain.elastic`).
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback

from .comm.life.abort import abort_job

__all__ = ["main", "abort_job"]

_EXIT_PREEMPTED = 75   # hpctrain.checkpoint.EXIT_PREEMPTED (not imported: this module stays light)


def main(argv=None) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its ``sys.argv``; abort the job if it raises."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.stderr.write("usage: python -m hpctrain.run script.py [args...]\n")
        sys.exit(2)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code not in (0, _EXIT_PREEMPTED):   # 75: every rank stops together after a checkpoint
            _leave_if_elastic(f"hpctrain.run: {argv[0]} exited with status {code}", code)
            abort_job(f"hpctrain.run: {argv[0]} exited with status {code}; ending the job", code)
        raise
    except BaseException as exc:
        from .world import is_initialized, world

        if getattr(exc, "every_rank", False):      # (raised alike on every rank: one line, the ranks leave together)
            if (world().rank if is_initialized() else 0) == 0:
                sys.stderr.write(f"hpctrain: error: {exc}\n")
                sys.stderr.flush()
            if is_initialized() and world().life.failure_policy.reforms:
                from .comm.life.abort import leave_with_the_others

                leave_with_the_others()
            sys.exit(1)
        if not isinstance(exc, KeyboardInterrupt):
            _leave_if_elastic(f"hpctrain.run: uncaught exception in {argv[0]}:\n{traceback.format_exc()}", 1)
        failed = world().life.failure_message() if is_initialized() else ""
        if failed:         # (an MPI call failed because ranks died or a node was lost: name them)
            world().life.exit_after_failure(f"{failed}\n(the exception in {argv[0]}: {type(exc).__name__}: {exc})")
        rank = world().rank if is_initialized() else os.environ.get("OMPI_COMM_WORLD_RANK", "?")
        abort_job(f"hpctrain.run: rank {rank}: uncaught exception in {argv[0]}, aborting the job:\n"
                  + traceback.format_exc())


def _leave_if_elastic(message: str, code: int) -> None:
    """In elastic mode (hpctrain.elastic), end only this process, as a failed rank: the other ranks re-form
    without it.  Returns when not in elastic mode."""
    from .world import is_initialized, world

    if is_initialized():
        world().life.failure_policy.fail_alone(world().rank, message)


if __name__ == "__main__":
    main()
