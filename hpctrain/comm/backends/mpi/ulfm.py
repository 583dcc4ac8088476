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
* :class:`Declarer`: declare other processes failed, as Open MPI's own
  heartbeat detector does (no MPI verb does this: it is Open MPI's exported
  ``ompi_errhandler_proc_failed_internal``, found in the loaded library and
  checked on this process's own name before use).

Cost: each is one library call (the shrink an agreement over the survivors).
"""
from __future__ import annotations

import ctypes
from typing import Iterable, List, Optional, Tuple

__all__ = ["available", "revoke", "shrink", "acknowledge", "failed_ranks", "Declarer"]


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


class _Name(ctypes.Structure):
    """Open MPI's process name (``opal_process_name_t``): job and rank in it."""
    _fields_ = [("jobid", ctypes.c_uint32), ("vpid", ctypes.c_uint32)]


_NAME_OFFSET = 40               # of ``proc_name`` in ``opal_proc_t`` (after its list item), checked in load()
_PROC_TERMINATED = -200         # PMIX_ERR_PROC_TERM_WO_SYNC: the status Open MPI's detector gives a silent process


class Declarer:
    """Declares processes failed in this process's Open MPI (ULFM), as its heartbeat detector would.

    ``declare(name)`` marks the process failed here and forwards the news to
    the other processes (Open MPI's reliable broadcast): their calls that wait
    on it end with ``MPI_ERR_PROC_FAILED``, and a shrink leaves it out.  Names
    are ``(job, rank)`` pairs as :meth:`own_name` gives them.  Use
    :meth:`load`, which returns None where the library is not Open MPI with
    ULFM or its layout is not the one expected.
    """

    def __init__(self, lib, local: int):
        self._lib, self._local = lib, local

    @classmethod
    def load(cls, world_rank: int) -> Optional["Declarer"]:
        """The declarer of this process, or None (not Open MPI 5 with ULFM, or its process name is not where
        expected: checked by looking our own name up, and against ``world_rank``, our rank in MPI_COMM_WORLD)."""
        try:
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps if "/libmpi.so" in line), None)
            if path is None:
                return None
            lib = ctypes.CDLL(path)
            find, declare = lib.ompi_proc_for_name, lib.ompi_errhandler_proc_failed_internal
            local = ctypes.c_void_p.in_dll(lib, "ompi_proc_local_proc").value
        except (OSError, AttributeError, ValueError):
            return None
        find.restype, find.argtypes = ctypes.c_void_p, [_Name]
        declare.restype, declare.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_bool]
        if not local:
            return None
        me = _Name.from_address(local + _NAME_OFFSET)
        if me.vpid != world_rank or find(_Name(me.jobid, me.vpid)) != local:
            return None
        return cls(lib, local)

    def own_name(self) -> Tuple[int, int]:
        """This process's (job, rank) name."""
        me = _Name.from_address(self._local + _NAME_OFFSET)
        return int(me.jobid), int(me.vpid)

    def declare(self, name: Tuple[int, int]) -> bool:
        """Declare the process ``name`` failed (here and, forwarded, everywhere); False if it is unknown here."""
        proc = self._lib.ompi_proc_for_name(_Name(*name))
        if not proc or proc == self._local:
            return False
        return self._lib.ompi_errhandler_proc_failed_internal(proc, _PROC_TERMINATED, True) == 0
