"""The MPI backend: collectives through mpi4py, and hpctrain's own algorithms over MPI messages.

Each communicator duplicates its MPI communicator three times so that the
call check, hpctrain's algorithms and the user's point-to-point messages can
never match each other's messages.  On one node the call check is one
exchange through shared memory (:mod:`hpctrain.comm.backends.mpi.mailbox`), which small
inputs ride along with (:mod:`hpctrain.comm.backends.mpi.mailbox_collectives`).  Across nodes it is a gather to rank 0 and
a reply (``2 (n-1)`` messages of at most 512 bytes), done with non-blocking
receives so that rank 0 always knows which ranks have not joined yet.  Either
way the watchdog shows the ranks not yet joined when a collective stalls.

Large all-reduces on one node copy straight between the ranks' memory where
the kernel allows it (:mod:`hpctrain.comm.backends.mpi.cross_memory`, probed once per
communicator, all local ranks agreeing), else stage through the node's
shared-memory arena (:mod:`hpctrain.collectives.shm`).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import numpy as np

from ....errors import format_ranks
from ....tensors import dtype_from_name
from ....collectives.flat import Flat
from ....collectives.ring import ring_allgather_segments
from ....collectives.shm import shm_allgather, shm_allreduce, shm_allreduce_shared_buffer, shm_reduce_scatter
from .direct import DIRECT_MIN_BYTES, DirectCopies
from .requests import RequestHandle, RingTransport, Waits
from ...base import Communicator, Handle, CarriedByCheck, Topology
from ..primitives import Primitives
from .mailbox import Mailbox
from .mailbox_collectives import MailboxCollectives
from .half_ops import HalfOps
from . import ulfm
from .node import NodeGroups, SharedArena, SharedBuffer, release_window, shared_window
from ...life.runtime import Runtime
from ...call.signature import DESC_BYTES, Call, encoded, judge

__all__ = ["MPIBackend"]

VERDICT_BYTES = 1 << 16
_TAG_CALL, _TAG_VERDICT = 1, 2


class MPIBackend(Primitives):
    """The primitives of an mpi4py communicator (see module docstring)."""

    kind = "mpi"

    def __init__(self, runtime: Runtime, comm, name: str, world_ranks, owns: bool):
        from mpi4py import MPI

        self._MPI = MPI
        self._base, self._owns = comm, owns
        self._coll, self._p2p, self._ctrl = comm.Dup(), comm.Dup(), comm.Dup()
        world_ranks = list(world_ranks)
        self._nodes = NodeGroups(comm, world_ranks[comm.Get_rank()], MPI)
        self._arena: Optional[SharedArena] = None
        self._buffers: Dict[int, SharedBuffer] = {}     # data address -> buffer from shared_empty
        self._waits = Waits(MPI, runtime if runtime.policy.reforms else None)
        self._cross = RingTransport(self._nodes.cross, self._waits) if self._nodes.cross is not None else None
        g = self._nodes
        topology = Topology(g.local_rank, g.local_size, g.node_rank, g.num_nodes)
        super().__init__(runtime, comm.Get_rank(), comm.Get_size(), name, world_ranks, topology)
        self._ops = {"sum": MPI.SUM, "avg": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
        self._half_ops = HalfOps(MPI)       # (float16 and bfloat16 through the library: half_ops.py)
        self._descs = np.zeros((self._size if self._rank == 0 else 1, DESC_BYTES), dtype=np.uint8)
        self._verdict = np.zeros(VERDICT_BYTES, dtype=np.uint8)
        self._ring = RingTransport(self._coll, self._waits)
        # (a world that re-forms, across nodes: Open MPI 5.0's all-gather can stall for good when a rank dies in it)
        self._fault_tolerant_only = runtime.policy.reforms and g.num_nodes > 1
        self._mailbox: Optional[Mailbox] = None
        self._no_windows = ""                 # why shared-memory windows cannot be used here ("" if they can)
        self._direct = DirectCopies(self._nodes, MPI, runtime)
        self._forget_revoke = runtime.policy.on_revoke(self._revoke)      # (elastic mode: failures revoke it)
        on_node = MailboxCollectives(self)      # its primitives in place of the defaults (None without a mailbox)
        for primitive in MailboxCollectives.PRIMITIVES:
            setattr(self, primitive, getattr(on_node, primitive))
        if self._size > 1:
            self._open_windows()

    def _open_windows(self) -> None:
        """Open the one-node mailbox (or, across nodes, try one shared window); all ranks agree whether it worked.

        An MPI without MPI-3 shared windows (no ``osc/sm`` component, say)
        fails the allocation on every rank; then the call check uses the
        gather to rank 0, ``auto`` picks "native", ``shared_empty`` is
        ``numpy.empty`` and "shm"/"hierarchical" are refused with the reason.
        Cost: one allocation and one small all-reduce when the communicator is made.
        """
        MPI, g, why = self._MPI, self._nodes, ""
        try:
            if g.num_nodes == 1:
                cfg = self._rt.config
                self._mailbox = Mailbox(g.node, MPI, 2 * cfg.shm_small_bytes, self._p2p.Iprobe, cfg.native_kernel)
            elif g.local_size > 1:
                release_window(shared_window(g.node, MPI, 64)[0])
        except MPI.Exception as exc:
            why = f"MPI_Win_allocate_shared failed: {exc}"
        if self._ctrl.allreduce(not why, op=MPI.LAND):
            return
        if self._mailbox is not None:
            self._mailbox.free()
            self._mailbox = None
        self._no_windows = (f"this MPI cannot allocate MPI-3 shared-memory windows on the ranks of {self.name} "
                            f"({why or 'on another rank'})")

    # -- call check ---------------------------------------------------------
    def exchange_calls(self, call: Call, carried: Optional[CarriedByCheck] = None) -> str:
        if self._mailbox is not None:
            return self._exchange_on_node(call, carried)
        MPI, n, rt = self._MPI, self._size, self._rt
        own = np.frombuffer(call.encode(), dtype=np.uint8)
        self._descs[0, :] = 0
        self._descs[0, :own.size] = own
        if self._rank != 0:
            status = MPI.Status()
            rt.note_waiting(f"waiting for rank 0 of {self.name} (world rank {self.world_ranks[0]}) "
                            f"to hear from every rank; rank 0 names the missing ones")
            reqs = [self._ctrl.Isend(self._descs[0], 0, _TAG_CALL),
                    self._ctrl.Irecv(self._verdict, 0, _TAG_VERDICT)]
            self._waits.all(reqs, [MPI.Status(), status])
            return bytes(self._verdict[:status.Get_count(MPI.BYTE)]).decode()
        reqs = [self._ctrl.Irecv(self._descs[i], i, _TAG_CALL) for i in range(1, n)]
        missing = set(range(1, n))
        while missing:
            rt.note_waiting(f"not yet joined by {format_ranks(sorted(missing))} of {self.name} "
                            f"(world {format_ranks([self.world_ranks[i] for i in missing])})")
            for i in self._waits.some(reqs):
                missing.discard(i + 1)
        verdict = judge(list(self._descs), self.name, call.seq,
                        None if self.name == "world" else self.world_ranks)
        payload = np.frombuffer(verdict.encode()[:VERDICT_BYTES], dtype=np.uint8)
        self._waits.all([self._ctrl.Isend(payload, i, _TAG_VERDICT) for i in range(1, n)])
        return verdict

    def _exchange_on_node(self, call: Call, carried: Optional[CarriedByCheck]) -> str:
        key_hash, desc = encoded(call)
        payload, dtype, announce = (None, None, 0) if carried is None else (carried.payload, carried.dtype,
                                                                             carried.announce)
        if self._mailbox.exchange(key_hash, desc, payload, dtype, self._note_missing, announce) and not call.error:
            return ""
        return self._mismatch(call.seq)

    def _mismatch(self, seq: int) -> str:
        """Return the error message for call ``seq`` from every rank's call in the mailbox."""
        return judge(self._mailbox.calls(), self.name, seq, None if self.name == "world" else self.world_ranks)

    def _note_missing(self, missing: List[int]) -> None:
        self._rt.note_waiting(f"not yet joined by {format_ranks(missing)} of {self.name} "
                              f"(world {format_ranks([self.world_ranks[i] for i in missing])})")

    # -- buffer primitives -----------------------------------------------------
    def allreduce_native(self, acc: np.ndarray, op: str) -> np.ndarray:
        self._coll.Allreduce(self._MPI.IN_PLACE, *self.library_args(acc, op))
        return acc

    def library_args(self, buf: np.ndarray, op: str):
        """``(buffer, MPI op)`` for the library's reduction of ``buf`` (16-bit floats: :mod:`.half_ops`)."""
        return self._half_ops.args(buf, op, self._ops[op])

    def transport(self):
        return self._ring

    def no_shared_memory(self) -> str:
        return self._no_windows

    def _shared(self) -> SharedArena:
        if self._arena is None:
            self._arena = SharedArena(self._nodes.node, self._MPI, self._rt.config.shm_arena_bytes)
        return self._arena

    def allreduce_shared(self, x: Flat, out: Flat, op: str, alg: str, divisor: int = 1) -> None:
        itemsize = out.arrays[0].itemsize if out.arrays else 1
        nbytes = x.size * itemsize
        if self._nodes.num_nodes == 1 and nbytes >= DIRECT_MIN_BYTES and x.arrays[0].dtype == out.arrays[0].dtype:
            least = self._direct.min_bytes()
            if least is not None and nbytes >= least:
                self._direct.allreduce(x, out, op, f"rank {self._rank} of {self.name}", divisor)
                return
        shm_allreduce(x, out, op, self._shared(), parts=self._nodes.parts, cross=self._cross,
                      chunk_elems=self.chunk_elems(itemsize), divisor=divisor, phase=self._rt.timeline.phase)

    def reduce_scatter_shared(self, x: np.ndarray, bounds, acc_dtype, op: str) -> np.ndarray:
        return shm_reduce_scatter(x, bounds, acc_dtype, op, self._shared(), phase=self._rt.timeline.phase)

    def allgather_shared(self, raw: np.ndarray, counts: List[int]) -> Optional[np.ndarray]:
        if self._nodes.num_nodes > 1 or self._no_windows:
            return None
        return shm_allgather(raw, counts, self._shared(), phase=self._rt.timeline.phase)

    def shared_empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        if self._size == 1 or count == 0 or self._no_windows:   # (a node of one rank still needs one)
            return np.empty(count, dtype=dtype)
        buf = SharedBuffer(self._nodes.node, self._MPI, count, dtype)
        self._buffers[buf.own.ctypes.data] = buf
        return buf.own

    def shared_buffer_of(self, arr: np.ndarray):
        buf = self._buffers.get(arr.ctypes.data)
        if buf is None or arr.size != buf.count or arr.dtype != buf.dtype or not arr.flags.c_contiguous:
            return None
        return buf

    def reduce_shared_buffer(self, buf, op: str, divisor: int = 1) -> None:
        shm_allreduce_shared_buffer(buf, op, parts=self._nodes.parts, cross=self._cross,
                                    chunk_elems=self.chunk_elems(buf.dtype.itemsize), divisor=divisor,
                                    phase=self._rt.timeline.phase)

    def release_shared(self) -> None:
        if self._arena is not None:
            self._arena.free()
            self._arena = None
        for buf in self._buffers.values():
            buf.free()
        self._buffers = {}

    def allgather_ints(self, value: int) -> List[int]:
        out = np.empty(self._size, dtype=np.int64)
        self._coll.Allgather(np.array([value], dtype=np.int64), out)
        return out.tolist()

    def alltoall_ints(self, values: List[int]) -> List[int]:
        out = np.empty(self._size, dtype=np.int64)
        self._coll.Alltoall(np.asarray(values, dtype=np.int64), out)
        return out.tolist()

    def allgatherv(self, raw: np.ndarray, counts: List[int]) -> np.ndarray:
        out = np.empty(sum(counts), dtype=np.uint8)
        if self._fault_tolerant_only:
            bounds = np.concatenate(([0], np.cumsum(counts)))
            out[bounds[self._rank]:bounds[self._rank + 1]] = raw
            ring_allgather_segments(out, bounds, self._ring)
            return out
        displs = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()
        self._coll.Allgatherv(raw, [out, counts, displs, self._MPI.BYTE])
        return out

    def broadcast(self, raw: np.ndarray, root: int) -> None:
        self._coll.Bcast(raw, root)

    def reduce_scatter_native(self, acc: np.ndarray, counts: List[int], op: str) -> np.ndarray:
        out = np.empty(counts[self._rank], dtype=acc.dtype)
        buf, mpi_op = self.library_args(acc, op)
        self._coll.Reduce_scatter(buf, out.view(buf.dtype), counts, op=mpi_op)
        return out

    def alltoallv(self, raw: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
        out = np.empty(sum(recv), dtype=np.uint8)
        sd = np.concatenate(([0], np.cumsum(send)[:-1])).tolist()
        rd = np.concatenate(([0], np.cumsum(recv)[:-1])).tolist()
        B = self._MPI.BYTE
        self._coll.Alltoallv([raw, send, sd, B], [out, recv, rd, B])
        return out

    def barrier(self) -> None:
        self._coll.Barrier()

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self._coll.bcast(obj, root)

    def allgather_object(self, obj: Any) -> List[Any]:
        return self._coll.allgather(obj)

    def isend(self, arr: np.ndarray, dest: int, tag: int) -> Handle:
        header = np.frombuffer(json.dumps({"dtype": str(arr.dtype), "shape": list(arr.shape)}).encode(),
                               dtype=np.uint8)
        reqs = [self._p2p.Isend(header, dest, tag), self._p2p.Isend(arr.reshape(-1).view(np.uint8), dest, tag)]
        return RequestHandle(reqs, (header, arr), self._waits)

    def recv(self, source: int, tag: int) -> np.ndarray:
        MPI = self._MPI
        status = MPI.Status()
        self._p2p.Probe(source, tag, status)
        header = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
        self._p2p.Recv(header, source, tag)
        meta = json.loads(header.tobytes())
        out = np.empty(meta["shape"], dtype=dtype_from_name(meta["dtype"]))
        self._p2p.Recv(out.reshape(-1).view(np.uint8), source, tag)
        return out

    def isend_bytes(self, raw: np.ndarray, dest: int, tag: int) -> Handle:
        return RequestHandle([self._p2p.Isend(raw, dest, tag)], (raw,), self._waits)

    def recv_bytes(self, source: int, tag: int) -> np.ndarray:
        status = self._MPI.Status()
        self._p2p.Probe(source, tag, status)
        out = np.empty(status.Get_count(self._MPI.BYTE), dtype=np.uint8)
        self._p2p.Recv(out, source, tag)
        return out

    def iprobe(self, source: int, tag: int):
        MPI, status = self._MPI, self._MPI.Status()
        try:
            if not self._p2p.Iprobe(MPI.ANY_SOURCE if source < 0 else source, MPI.ANY_TAG if tag < 0 else tag,
                                    status):
                return None
        except MPI.Exception as exc:
            self._failed_peers(exc)
            raise
        return status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)

    def recv_found(self, source: int, tag: int) -> np.ndarray:
        try:
            return self.recv_bytes(source, tag)
        except self._MPI.Exception as exc:
            self._failed_peers(exc)
            raise

    def _failed_peers(self, exc) -> None:
        """After ``exc`` from a receive: when ranks failed (ULFM), acknowledge them (so that receives from any
        source go on with the others) and raise RanksFailedError naming them; else return."""
        MPI = self._MPI
        if exc.Get_error_class() not in (MPI.ERR_PROC_FAILED, getattr(MPI, "ERR_PROC_FAILED_PENDING", -1)):
            return
        from ....errors import RanksFailedError

        ulfm.acknowledge(self._p2p)
        mine = self._p2p.Get_group()
        try:
            failed = sorted(self.world_ranks[r] for r in ulfm.failed_ranks(self._p2p, mine))
        finally:
            mine.Free()
        raise RanksFailedError(f"hpctrain: rank {self._rank} of {self.name}: world {format_ranks(failed)} failed "
                               f"(the process died or its node was lost)", failed) from exc

    def split(self, color: Optional[int], key: int) -> Optional[Communicator]:
        MPI = self._MPI
        sub = self._base.Split(MPI.UNDEFINED if color is None else int(color), key)
        if sub == MPI.COMM_NULL:
            return None
        members = sub.allgather(self.world_ranks[self._rank])
        return Communicator(MPIBackend(self._rt, sub, f"{self.name}.split({color})", members, owns=True))

    def _revoke(self) -> None:
        """Revoke the MPI communicators under this one (elastic mode, after a failure): every call on them on every
        survivor, the shared-memory waits too (their barriers and the mailbox's probes use them), ends in MPI_ERR_REVOKED."""
        ulfm.revoke((self._coll, self._p2p, self._ctrl, self._nodes.node, self._nodes.cross, self._base), self._MPI)

    @property
    def mpi_comm(self):
        """The mpi4py communicator this one is made over (what the survivors shrink after a failure)."""
        return self._base

    def free(self) -> None:
        self._forget_revoke()
        self.release_shared()
        if self._mailbox is not None:
            self._mailbox.free()
            self._mailbox = None
        self._nodes.free()
        for c in (self._coll, self._p2p, self._ctrl) + ((self._base,) if self._owns else ()):
            if c != self._MPI.COMM_NULL:
                c.Free()
        self._owns = False

