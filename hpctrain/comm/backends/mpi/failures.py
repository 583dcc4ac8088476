"""Ranks that failed (a killed process, a lost node), as MPI's fault-tolerance extension (ULFM) reports them.

Open MPI 5 started with ``mpirun --with-ft ulfm`` (``hpctrain launch`` does so
where the library has it) keeps the survivors running when a process dies and
tells them which ones did; without it the first process to hear of the death
ends the job with a message of Open MPI's, which may name the survivor that
noticed rather than the process or node that was lost.  :class:`FailureDetector`
asks on a communicator of its own: one ``Iprobe`` (which lets MPI take in
failure notices) and ``MPI_Comm_get_failed``, both local calls.  The watchdog
(:mod:`hpctrain.comm.life.runtime`) asks every period and ends the job naming the
failed world ranks and their nodes, once no more failures came for a moment
(:meth:`FailureDetector.settled`: a lost node's processes are reported one by one); so does the exception hook when an MPI
call failed because of them.  Where the library lacks the extension (or the
run was started without it) nothing is ever reported as failed.  In elastic
mode across nodes the detector also owns the world's heartbeat
(:mod:`~hpctrain.comm.backends.mpi.heartbeat`), which declares a silent node's
ranks failed to the library.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Sequence

from . import ulfm

__all__ = ["FailureDetector"]


class FailureDetector:
    """The failed world ranks of ``comm`` (a world communicator) and where they ran.

    Args:
        comm: the MPI world communicator (duplicated here).
        hosts: every world rank's host name, in rank order.
        MPI: the ``mpi4py.MPI`` module.
        heartbeat: the world's :class:`~hpctrain.comm.backends.mpi.heartbeat.Heartbeat`, or None.
    """

    def __init__(self, comm, hosts: Sequence[str], MPI, heartbeat=None):
        self.hosts = list(hosts)
        self.heartbeat = heartbeat
        self._MPI = MPI
        self._comm = comm.Dup()
        self._world = comm.Get_group()
        self._known: List[int] = []
        self._lock = threading.Lock()
        self.usable = ulfm.available(self._comm, MPI)

    def failed(self) -> List[int]:
        """The world ranks known to have failed (empty where ULFM is off or unavailable)."""
        with self._lock:
            if not self.usable or self._comm is None:
                return list(self._known)
            try:
                self._comm.Iprobe()                 # (progress: failure notices come in here)
            except self._MPI.Exception:
                pass                                # (a wildcard probe fails once a process has: as it should)
            ranks = ulfm.failed_ranks(self._comm, self._world)
            if len(ranks) > len(self._known):
                self._known = ranks
            return list(self._known)

    def settled(self, grace: float = 1.5, quiet: float = 0.3, first_within: float = 0.0) -> List[int]:
        """:meth:`failed`, and once something has failed, what failed by the time no news came for ``quiet``
        seconds (at most ``grace``): a lost node's processes are reported one by one, and the message
        should name them all.  ``first_within``: wait that long for a first failure to be reported (a call
        may fail, or be revoked by a peer, before this process's library lists the failed one)."""
        known = self.failed()
        deadline = time.monotonic() + first_within
        while not known and time.monotonic() < deadline:
            time.sleep(0.01)
            known = self.failed()
        if not known:
            return known
        start = last = time.monotonic()
        while time.monotonic() - start < grace and time.monotonic() - last < quiet:
            time.sleep(0.05)
            now = self.failed()
            if len(now) > len(known):
                known, last = now, time.monotonic()
        return known

    def describe(self, ranks: Sequence[int]) -> str:
        """Name ``ranks`` with their nodes: "world ranks 2, 3 on node node2"."""
        from ....errors import format_ranks

        by_host: Dict[str, List[int]] = {}
        for r in sorted(ranks):
            by_host.setdefault(self.hosts[r] if 0 <= r < len(self.hosts) else "?", []).append(r)
        return "; ".join(f"world {format_ranks(rs)} on node {host}" for host, rs in by_host.items())

    def discard(self) -> None:
        """Stop the heartbeat without a word (the world re-forms; its communicator is left to the process's end)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def free(self) -> None:
        """Stop the heartbeat, telling the other nodes the world ends, and release the communicator."""
        if self.heartbeat is not None:
            self.heartbeat.stop(leaving=True)
        with self._lock:
            if self._comm is not None:
                self._world.Free()
                self._comm.Free()
                self._comm = None
