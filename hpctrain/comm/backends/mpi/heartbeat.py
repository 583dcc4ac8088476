"""hpctrain's heartbeat across nodes, off MPI's data path: a node gone silent is declared failed to ULFM.

A node that freezes or is cut off closes no connection, so nothing tells the
survivors.  Here the first rank of each node (its speaker) sends a datagram
(UDP, on a socket of its own: not MPI's connections) to every other node's
speaker every ``T / 8`` seconds from a thread of its own, ``T`` being
HPCTRAIN_ELASTIC_SILENT_S.  A node not heard from for ``T`` is declared lost:
the speaker sends every rank of the world a verdict naming the lost node's
ranks (again every period, so that the other side of a partition that heals
hears it too), and each rank declares those ranks failed to its MPI library
the way Open MPI's own heartbeat detector does
(:class:`~hpctrain.comm.backends.mpi.ulfm.Declarer`): their pending calls end
with ``MPI_ERR_PROC_FAILED``, and the survivors re-form
(:mod:`hpctrain.elastic.reform`) without them.  A rank that a verdict names
was cut off while the others went on: it ends.

Why not Open MPI's detector (``--mca mpi_ft_detector true``): its beats travel
on MPI's own TCP connections behind the data, so a congested link delays them
by as long as its backlog takes (1 MiB all-reduces over 1 Mbit/s links had
healthy ranks declared dead); a datagram waits only for the link's queue.

Within a node nothing beats: a rank that dies there is reported by the runtime
at once, one that hangs is the stall watchdog's (HPCTRAIN_STALL_TIMEOUT_S).  A
node is watched through its speaker, so that process frozen alone loses its
node.  A rank whose thread cannot run for ``T`` (a C extension holding
Python's lock that long) is taken for silent.  A node never heard from is
never declared (datagrams may be blocked between the nodes: a warning says so
after ``2 T``).

Cost: per period each speaker sends ``H - 1`` datagrams of 28 bytes (``H``
nodes) and every rank's thread wakes once; nothing on MPI's data path; one
all-gather of addresses when a world is made.
"""
from __future__ import annotations

import ipaddress
import os
import select
import socket
import struct
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

__all__ = ["Heartbeat", "node_keys", "minority_side"]

_HEADER = struct.Struct("!4sB16sI")     # magic, kind, the world's key, the sender's node index
_MAGIC = b"HPHB"
_BEAT, _VERDICT, _LEAVING = 1, 2, 3
_BEATS_PER_TIMEOUT = 8


def minority_side(size: int, gone: Sequence[int]) -> bool:
    """Whether the ranks left of a world of ``size`` after losing ``gone`` must end: they may be a partition's lesser side.

    With heartbeats (this module's, or Open MPI's detector) a silent rank is
    declared failed, so both sides of a network partition see the other fail
    and would each go on (two trainings writing the same checkpoints).  Only
    one side can hold more than half of the old ranks, or exactly half with
    old rank 0 (where the launcher runs): that side goes on, the other ends
    (:func:`hpctrain.elastic.reform`); and a verdict from the lesser side is
    not acted on here.  Cost: none.
    """
    kept = size - len(set(gone))
    return 2 * kept < size or (2 * kept == size and 0 in gone)


def node_keys(hosts: Sequence[str], ranks_per_fake_node: Optional[int]) -> List[str]:
    """Each world rank's node: its host, or with HPCTRAIN_RANKS_PER_NODE=k the fake node ``rank // k`` on it."""
    if not ranks_per_fake_node:
        return list(hosts)
    return [f"{h}/{r // ranks_per_fake_node}" for r, h in enumerate(hosts)]


def _addresses() -> List[Tuple[str, str]]:
    """This host's IPv4 addresses with their netmasks (loopback last)."""
    import psutil

    found = [(a.address, a.netmask or "255.255.255.255") for addrs in psutil.net_if_addrs().values()
             for a in addrs if a.family == socket.AF_INET]
    return sorted(found, key=lambda a: a[0].startswith("127."))


def _reachable(mine: Sequence[Tuple[str, str]], theirs: Sequence[Tuple[str, str]], same_host: bool) -> str:
    """The address of ``theirs`` to send to: one on a network of ours, else their first that is not loopback."""
    if same_host:
        return "127.0.0.1"
    nets = [ipaddress.ip_network(f"{a}/{m}", strict=False) for a, m in mine if not a.startswith("127.")]
    for address, _ in theirs:
        if any(ipaddress.ip_address(address) in net for net in nets):
            return address
    return next((a for a, _ in theirs if not a.startswith("127.")), theirs[0][0] if theirs else "127.0.0.1")


class Heartbeat:
    """The heartbeat of one world (module docstring): start it on every rank of ``comm`` at once.

    Args:
        comm: the world's MPI communicator (one all-gather and one broadcast on it here).
        nodes: each rank's node key (:func:`node_keys`), in rank order.
        silent_s: ``T``: a node not heard from this long is lost.
        declarer: this process's :class:`~hpctrain.comm.backends.mpi.ulfm.Declarer`.
        cut_off: called with a message when a verdict names this rank (it should end the process).
    """

    def __init__(self, comm, nodes: Sequence[str], silent_s: float, declarer, cut_off: Callable[[str], None]):
        self.silent_s = float(silent_s)
        self.rank = comm.Get_rank()
        order = sorted(set(nodes), key=list(nodes).index)
        self._node_of = [order.index(n) for n in nodes]
        self._speakers = {i: self._node_of.index(i) for i in range(len(order))}
        self._node_names = order
        self._declarer, self._cut_off = declarer, cut_off
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("0.0.0.0", 0))
        mine = _addresses()
        peers = comm.allgather((socket.gethostname(), mine, self._sock.getsockname()[1], declarer.own_name()))
        self._key = comm.bcast(os.urandom(16) if self.rank == 0 else None, root=0)
        here = socket.gethostname()
        self._to = [(_reachable(mine, addrs, host == here), port) for host, addrs, port, _ in peers]
        self._names = [name for _, _, _, name in peers]
        self._lost: Set[int] = set()          # world ranks declared failed here
        self._lost_nodes: Set[int] = set()
        self._left: Set[int] = set()          # nodes whose speaker said the job is ending
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpctrain-heartbeat", daemon=True)
        self._thread.start()

    @property
    def speaker(self) -> bool:
        """Whether this rank beats for its node."""
        return self._speakers[self._node_of[self.rank]] == self.rank

    def stop(self, leaving: bool = False) -> None:
        """Stop beating (at the world's end ``leaving``: the other speakers stop watching this node)."""
        if self._stop.is_set():
            return
        if leaving and self.speaker:
            self._send(_LEAVING, b"", self._other_speakers())
        self._stop.set()
        try:
            self._sock.sendto(b"", ("127.0.0.1", self._sock.getsockname()[1]))     # (wakes the thread)
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._sock.close()

    # -- the thread -------------------------------------------------------
    def _run(self) -> None:
        period = self.silent_s / _BEATS_PER_TIMEOUT
        start = time.monotonic()
        # (a node never heard from is not declared: datagrams may be blocked between the nodes; said once)
        heard: Dict[int, Optional[float]] = {n: None for n in self._speakers if n != self._node_of[self.rank]}
        unheard_said = False
        next_beat = start
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                ready, _, _ = select.select([self._sock], [], [], max(0.0, next_beat - now))
                if ready:
                    self._receive(heard)
                now = time.monotonic()
                if now < next_beat or self._stop.is_set():
                    continue
                next_beat = now + period
                if self.speaker:
                    self._send(_BEAT, b"", self._other_speakers())
                    silent = [n for n, t in heard.items() if t is not None and now - t > self.silent_s
                              and n not in self._lost_nodes and n not in self._left]
                    unheard = [self._node_names[n] for n, t in heard.items() if t is None and n not in self._left]
                    if unheard and not unheard_said and now - start > 2 * self.silent_s:
                        unheard_said = True
                        sys.stderr.write(f"hpctrain: rank {self.rank}: warning: no heartbeat from node "
                                         f"{', '.join(unheard)} in {2 * self.silent_s:g} s (are UDP datagrams to "
                                         f"port {self._to[self.rank][1]} and the like blocked between the nodes?); "
                                         f"this node would not notice it go silent\n")
                        sys.stderr.flush()
                    if silent:
                        self._lost_nodes.update(silent)
                        self._declare({r for r, n in enumerate(self._node_of) if n in silent})
                    if self._lost:          # (every period: a cut-off side that comes back hears it)
                        self._send(_VERDICT, self._verdict(), [r for r in range(len(self._to)) if r != self.rank])
        except OSError:                      # (the socket closed under a stopping world)
            if not self._stop.is_set():
                raise

    def _receive(self, heard: Dict[int, Optional[float]]) -> None:
        while True:
            try:
                data = self._sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if len(data) < _HEADER.size:
                continue
            magic, kind, key, node = _HEADER.unpack_from(data)
            if magic != _MAGIC or key != self._key:
                continue                    # (another job's, or an earlier world's)
            if kind == _BEAT and node in heard:
                heard[node] = time.monotonic()
            elif kind == _LEAVING:
                self._left.add(node)
            elif kind == _VERDICT:
                ranks = set(struct.unpack_from(f"!{(len(data) - _HEADER.size) // 4}I", data, _HEADER.size))
                if not minority_side(len(self._to), ranks):     # (the sender's side ends: a healed partition)
                    self._declare(ranks, by=node)

    def _declare(self, ranks: Set[int], by: Optional[int] = None) -> None:
        new = sorted(set(ranks) - self._lost)
        if not new:
            return
        if self.rank in new:
            nodes = sorted({self._node_names[self._node_of[r]] for r in new})
            self._cut_off(f"hpctrain: rank {self.rank}: node {self._node_names[by] if by is not None else '?'} did "
                          f"not hear from node {', '.join(nodes)} for {self.silent_s:g} s "
                          f"(HPCTRAIN_ELASTIC_SILENT_S) and the job went on without it; this rank ends")
            return
        self._lost.update(new)
        for r in new:
            self._declarer.declare(self._names[r])

    def _verdict(self) -> bytes:
        lost = sorted(self._lost)
        return struct.pack(f"!{len(lost)}I", *lost)

    def _other_speakers(self) -> List[int]:
        mine = self._node_of[self.rank]
        return [r for n, r in self._speakers.items() if n != mine and n not in self._lost_nodes]

    def _send(self, kind: int, body: bytes, ranks: Sequence[int]) -> None:
        packet = _HEADER.pack(_MAGIC, kind, self._key, self._node_of[self.rank]) + body
        for r in ranks:
            try:
                self._sock.sendto(packet, self._to[r])
            except OSError:                  # (no route to a cut-off node: it is being declared lost)
                pass
