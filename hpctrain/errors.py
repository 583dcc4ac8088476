"""Exceptions raised by hpctrain, the exit status of a job stopped by its preemption save, and how every message
names ranks (:func:`format_ranks`)."""
from typing import Sequence

__all__ = ["HpctrainError", "CollectiveMismatchError", "InvalidCollectiveError", "NotInitializedError", "BackendUnavailableError",
           "CheckpointError", "ShutdownError", "WorldFailedError", "format_ranks"]


EXIT_PREEMPTED = 75   # EX_TEMPFAIL: the job stopped early on purpose (a preemption save) and may be run again to resume


class HpctrainError(RuntimeError):
    """Base class of hpctrain's errors."""


class CollectiveMismatchError(HpctrainError, ValueError, TypeError):
    """Ranks made incompatible collective calls; raised on every rank with each rank's call.

    It is also a ValueError and a TypeError, so code that catches the error a
    single process raises for the same bad argument catches it too.  ``every_rank``: raised alike on every
    rank (the call check's verdict, which every rank builds from every rank's call): uncaught, it is then one
    message on rank 0 and the ranks leave together (:mod:`hpctrain.run`), not a traceback each.
    """

    def __init__(self, message: str = "", every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class InvalidCollectiveError(CollectiveMismatchError):
    """Every rank made the same collective call with the same invalid argument; raised on every rank."""


class NotInitializedError(HpctrainError):
    """A world-level function was called before ``hpctrain.init()``."""


class BackendUnavailableError(HpctrainError):
    """The requested backend cannot run here (a library is missing or the launch is broken)."""


class CheckpointError(HpctrainError):
    """A checkpoint could not be saved or restored; raised on every rank."""

    every_rank = True       # (raised alike on every rank: uncaught, it is one line on rank 0, not a traceback each)


class ShutdownError(HpctrainError):
    """Something registered to run at shutdown (a timeline, metrics or checkpoint flush) failed on this rank.

    Raised after the rest of the shutdown ran and the rank left with the others.
    """


class WorldFailedError(HpctrainError):
    """Ranks of the world failed (their process died or their node was lost) during a collective.

    Raised, in elastic mode only (``HPCTRAIN_ELASTIC``), by the collective a
    survivor was in or calls next; ``failed`` holds the failed world ranks.
    :func:`hpctrain.elastic.run` catches it and re-forms the world; outside
    elastic mode a failed rank ends the job instead.
    """

    def __init__(self, message: str, failed=()):
        super().__init__(message)
        self.failed = list(failed)


class RanksFailedError(HpctrainError):
    """Ranks a point-to-point receive could hear from have failed (their process died or their node was lost).

    Raised by :meth:`~hpctrain.comm.base.Communicator.recv_any` and ``probe``
    under MPI's fault-tolerance extension, after the failure was acknowledged:
    the communicator stays usable with the other ranks (a parameter server goes
    on without a lost worker).  ``failed`` holds the failed world ranks.
    """

    def __init__(self, message: str, failed=()):
        super().__init__(message)
        self.failed = list(failed)


def format_ranks(ranks: Sequence[int]) -> str:
    """Return ``"rank 3"`` or ``"ranks 0-2, 5"`` for a sorted list of ranks."""
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)
