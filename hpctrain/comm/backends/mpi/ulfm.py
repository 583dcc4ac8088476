"""MPI's fault-tolerance verbs (ULFM, ``--with-ft ulfm``) on mpi4py communicators: the one place hpctrain calls them.

* :func:`revoke`: every call on the communicators, on every rank, ends with
  ``MPI_ERR_REVOKED`` (how a survivor wakes the others blocked in a
  collective with a failed rank).
* :func:`shrink`: a new communicator of the survivors (``MPI_Comm_shrink``:
  one fault-tolerant agreement), errors returned, not fatal.
* :func:`acknowledge`: ``MPI_Comm_ack_failed``, after which receives from
  any source go on with the ranks left.
* :func:`failed_ranks`: the ranks known to have failed (``MPI_Comm_get_failed``),
  numbered in another group.
* :func:`available`: whether the library has the verbs at all.

Cost: each is one library call (the shrink an agreement over the survivors).
"""
from __future__ import annotations

from typing import Iterable, List

__all__ = ["available", "revoke", "shrink", "acknowledge", "failed_ranks"]


def available(comm, MPI) -> bool:
    """Whether ``comm``'s library answers ``MPI_Comm_get_failed`` (Open MPI built and started with ULFM)."""
    try:
        comm.Get_failed().Free()
        return True
    except (AttributeError, NotImplementedError, MPI.Exception):
        return False


def revoke(comms: Iterable, MPI) -> None:
    """Revoke each of ``comms`` that is a communicator (None and COMM_NULL are skipped; a failed revoke too)."""
    for c in comms:
        if c is not None and c != MPI.COMM_NULL:
            try:
                c.Revoke()
            except MPI.Exception:
                pass


def shrink(comm, MPI):
    """A new communicator of ``comm``'s surviving ranks (same order), whose errors are returned, not fatal."""
    survivors = comm.Shrink()
    survivors.Set_errhandler(MPI.ERRORS_RETURN)
    return survivors


def acknowledge(comm) -> bool:
    """Acknowledge ``comm``'s failed ranks, so that wildcard receives go on; False where there is no such verb."""
    if not hasattr(comm, "Ack_failed"):
        return False
    comm.Ack_failed()
    return True


def failed_ranks(comm, group) -> List[int]:
    """The ranks of ``comm`` known to have failed, as numbered in ``group`` (sorted)."""
    failed = comm.Get_failed()
    try:
        if failed.Get_size() == 0:
            return []
        return sorted(int(r) for r in failed.Translate_ranks(list(range(failed.Get_size())), group))
    finally:
        failed.Free()
