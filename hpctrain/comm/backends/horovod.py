"""The Horovod backend: collectives through Horovod's ops on CPU torch tensors.

Numpy buffers are wrapped as torch tensors without a copy
(``torch.from_numpy``) and handed to ``horovod.torch``; Horovod then runs them
over its MPI or Gloo controller (``horovodrun --gloo`` needs no MPI
launcher).  Horovod has no point-to-point messages, so ``send``/``recv`` and
``algorithm="ring"`` are refused with a clear error on this backend.
Sub-communicators are Horovod process sets (``hvd.init(process_sets="dynamic")``);
as Horovod registers process sets with every process, only the world can be
split.  Horovod's stall inspector is set from HPCTRAIN_STALL_WARNING_S /
HPCTRAIN_STALL_TIMEOUT_S so its messages name the ranks that have not joined.
"""
from __future__ import annotations

import os
import pickle
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ...env import detect_launcher
from ...errors import BackendUnavailableError, HpctrainError
from ...tensors import is_bfloat16
from ..life.abort import abort_job
from ...collectives.ops import finish
from ..base import Communicator, Topology
from .primitives import Primitives
from ...waiting import wait_until
from ..life.runtime import Config, Runtime
from ..call.signature import DESC_BYTES, Call, judge

__all__ = ["HorovodBackend", "init_world"]


class HorovodBackend(Primitives):
    """The primitives of a Horovod process set."""

    kind = "horovod"

    def __init__(self, runtime: Runtime, hvd, process_set, name: str, world_ranks, topology: Topology,
                 registry: Dict[Tuple[int, ...], Any]):
        import torch

        self._hvd, self._torch, self._ps = hvd, torch, process_set
        self._registry = registry
        rank = process_set.rank() if name != "world" else hvd.rank()
        size = process_set.size() if name != "world" else hvd.size()
        super().__init__(runtime, rank, size, name, world_ranks, topology)
        self._ops = {"sum": hvd.Sum, "avg": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "prod": hvd.Product}

    def _op_name(self, kind: str) -> str:
        # Horovod matches an operation across ranks by name.  Its default names count operations
        # per process, so they drift apart as soon as ranks run different process sets (a rank
        # alone in a set makes different calls from the others).  hpctrain runs one Horovod
        # operation at a time per process, so a fixed name per communicator and primitive is
        # unique while in flight and lets Horovod's response cache hit on repeated calls.
        return f"hpctrain.set{self._ps.process_set_id}.{kind}"

    def _t(self, arr: np.ndarray):
        # torch refuses to wrap read-only memory without a warning; such inputs are small.
        return self._torch.from_numpy(arr if arr.flags.writeable else arr.copy())

    def _wait(self, handle, abandon=None):
        """Return the result of a Horovod operation, sleeping between polls instead of spinning.

        Horovod's own wait spins on the handle (``sched_yield``), which takes
        the core from Horovod's background thread whenever ranks share cores.
        Sleeping 1/8 of the time waited so far (20 us to 1 ms) between polls
        adds at most 1/8 to an operation's latency and leaves the core free.
        ``abandon()``, when given, is asked every poll: an exception it returns
        is raised instead of waiting on (the operation stays with Horovod).
        """
        start = time.perf_counter()
        try:
            while not self._hvd.poll(handle):
                time.sleep(min(1e-3, max(2e-5, (time.perf_counter() - start) / 8)))
                reason = abandon() if abandon is not None else None
                if reason is not None:
                    raise reason
            return self._hvd.synchronize(handle)
        except Exception as exc:
            if "has been shut down" not in str(exc):
                raise
            cur = self._rt.collectives.inflight
            call = cur.describe() if cur is not None else "a collective"
            raise HpctrainError(f"rank {self._hvd.rank()}: another rank left the job (returned, exited or called "
                                f"hpctrain.shutdown()) or failed while this rank waits in {call}: Horovod was "
                                f"shut down there and does not say which rank; the MPI backend names it") from exc

    def named_allreduce_async(self, arr: np.ndarray, name: str, op: str, abandon=None) -> "NamedReduction":
        """Start a Horovod all-reduce of ``arr`` named ``name``, outside hpctrain's lane and call check.

        Horovod matches it across ranks by name, in any order and beside
        anything else in flight, and fuses it with other ready tensors in its
        own cycle: one Horovod operation instead of a call check and the
        reduction.  For negotiated callers (hpctrain.horovod), which compare
        the ranks' requests themselves.  ``op``: sum, avg, min, max or prod;
        float32/float64 and integer buffers (float16 and bfloat16 go through
        the lane).  The result is written into ``arr``.
        ``abandon``: see :meth:`_wait` (a caller that learns the other ranks
        will never start it).
        """
        handle = self._hvd.allreduce_async_(self._torch.from_numpy(arr), name=name, op=self._ops[op],
                                           process_set=self._ps)
        return NamedReduction(self, handle, arr, op, abandon)

    def gather_bytes(self, blob: np.ndarray, name: str) -> List[bytes]:
        """Return every rank's ``blob`` (uint8, any length), in rank order: one Horovod allgather named ``name``.

        Outside hpctrain's lane and call check, like :meth:`named_allreduce_async`:
        for hpctrain.horovod's negotiation cycle, which runs on its own thread
        and compares what it needs itself.
        """
        framed = np.concatenate([np.frombuffer(np.int64(blob.size).tobytes(), np.uint8), blob.reshape(-1)])
        data = self._wait(self._hvd.allgather_async(self._t(framed), name=name, process_set=self._ps)).numpy()
        out, at = [], 0
        for _ in range(self._size):
            n = int(data[at:at + 8].view(np.int64)[0])
            out.append(data[at + 8:at + 8 + n].tobytes())
            at += 8 + n
        return out

    def exchange_calls(self, call: Call, carried=None) -> str:
        own = np.zeros((1, DESC_BYTES), dtype=np.uint8)
        enc = np.frombuffer(call.encode(), dtype=np.uint8)
        own[0, :enc.size] = enc
        descs = self._wait(self._hvd.allgather_async(self._t(own), name=self._op_name("check"),
                                                     process_set=self._ps)).numpy()
        return judge(list(descs), self.name, call.seq, None if self.name == "world" else self.world_ranks)

    def allreduce_native(self, acc: np.ndarray, op: str) -> np.ndarray:
        if is_bfloat16(acc.dtype):     # (Horovod 0.28 has no bfloat16 reduction: in float32, 4 bytes a value)
            return self.allreduce_native(acc.astype(np.float32), op).astype(acc.dtype)
        return self._wait(self._hvd.allreduce_async(self._t(acc), op=self._ops[op], name=self._op_name("allreduce"),
                                                    process_set=self._ps)).numpy()

    def allgather_ints(self, value: int) -> List[int]:
        t = self._torch.tensor([value], dtype=self._torch.int64)
        return self._wait(self._hvd.allgather_async(t, name=self._op_name("allgather_ints"),
                                                    process_set=self._ps)).tolist()

    def alltoall_ints(self, values: List[int]) -> List[int]:
        t = self._torch.tensor(values, dtype=self._torch.int64)
        out = self._wait(self._hvd.alltoall_async(t, name=self._op_name("alltoall_ints"), process_set=self._ps))
        return (out[0] if isinstance(out, tuple) else out).tolist()

    def allgatherv(self, raw: np.ndarray, counts: List[int]) -> np.ndarray:
        return self._wait(self._hvd.allgather_async(self._t(raw), name=self._op_name("allgather"),
                                                    process_set=self._ps)).numpy()

    def broadcast(self, raw: np.ndarray, root: int) -> None:
        out = self._wait(self._hvd.broadcast_async(self._t(raw), self.world_ranks[root],
                                                   name=self._op_name("broadcast"), process_set=self._ps))
        raw[...] = out.numpy()

    def reduce_scatter_native(self, acc: np.ndarray, counts: List[int], op: str) -> np.ndarray:
        # Horovod splits dim 0 itself; reduce the whole buffer and keep this rank's block so the
        # split always follows hpctrain's (numpy.array_split) rule.
        full = self.allreduce_native(acc, op)
        start = sum(counts[:self._rank])
        return full[start:start + counts[self._rank]]

    def alltoallv(self, raw: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
        splits = self._torch.tensor(send, dtype=self._torch.int32)
        out = self._wait(self._hvd.alltoall_async(self._t(raw), splits=splits, name=self._op_name("alltoall"),
                                                  process_set=self._ps))
        return (out[0] if isinstance(out, tuple) else out).numpy()

    def barrier(self) -> None:
        self._hvd.barrier(process_set=self._ps)

    def broadcast_object(self, obj: Any, root: int) -> Any:
        return self._hvd.broadcast_object(obj, root_rank=self.world_ranks[root], name=self._op_name("broadcast_object"),
                                          process_set=self._ps)

    def allgather_object(self, obj: Any) -> List[Any]:
        # hvd.allgather_object has no process_set argument: gather pickled bytes ourselves.
        raw = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = self.allgather_ints(raw.size)
        data = self.allgatherv(raw, sizes)
        offs = np.concatenate(([0], np.cumsum(sizes)))
        return [pickle.loads(data[offs[i]:offs[i + 1]].tobytes()) for i in range(self._size)]

    def isend(self, arr: np.ndarray, dest: int, tag: int):
        raise ValueError("the horovod backend has no point-to-point messages (send/recv); "
                         "use backend='mpi' (launch with mpirun or srun)")

    def recv(self, source: int, tag: int) -> np.ndarray:
        return self.isend(np.empty(0), source, tag)

    recv_bytes = recv

    def iprobe(self, source: int, tag: int):
        return self.isend(np.empty(0), source, tag)

    def isend_bytes(self, raw: np.ndarray, dest: int, tag: int):
        return self.isend(raw, dest, tag)

    def split(self, color: Optional[int], key: int) -> Optional[Communicator]:
        if self.name != "world":
            raise ValueError("the horovod backend can only split the world communicator "
                             "(Horovod registers process sets with every process)")
        entries = self.allgather_object((color, key, self._rank))
        groups: Dict[int, list] = {}
        for c, k, r in entries:
            if c is not None:
                groups.setdefault(c, []).append((k, r))
        ordered = {c: tuple(r for _, r in sorted(groups[c])) for c in sorted(groups)}
        # Decide on every rank, from the same gathered entries, before registering anything:
        # Horovod process sets are collective and keep world order.
        bad = {c: ranks for c, ranks in ordered.items() if list(ranks) != sorted(ranks)}
        if bad:
            raise ValueError("the horovod backend orders sub-communicator ranks by world rank; use key "
                             f"values that keep that order (color -> ranks by key: {bad})")
        for ranks in ordered.values():
            if ranks not in self._registry:
                self._registry[ranks] = self._hvd.add_process_set(list(ranks))
        if color is None:
            return None
        ranks = ordered[color]
        ps = self._registry[ranks]
        return Communicator(HorovodBackend(self._rt, self._hvd, ps, f"{self.name}.split({color})", ranks,
                                           self.topology, self._registry))


class NamedReduction:
    """A Horovod all-reduce started by :meth:`HorovodBackend.named_allreduce_async`: ``wait()`` and ``test()``."""

    def __init__(self, comm: HorovodBackend, handle, arr: np.ndarray, op: str, abandon=None):
        self._comm, self._handle, self._arr, self._op, self._done = comm, handle, arr, op, False
        self._abandon = abandon

    def test(self) -> bool:
        """Whether the reduction has finished (then ``wait()`` returns at once)."""
        return self._done or bool(self._comm._hvd.poll(self._handle))

    def wait(self, timeout=None) -> np.ndarray:
        """Return the reduced buffer (``arr``, averaged for ``avg`` as hpctrain's reductions do); TimeoutError
        after ``timeout`` s."""
        if not self._done:
            wait_until(self.test, timeout, "Horovod's reduction")
            self._comm._wait(self._handle, self._abandon)
            self._done = True
            finish(self._arr, self._op, self._comm.size, self._arr.dtype)
        return self._arr


def init_world(config: Config) -> Communicator:
    """Initialise Horovod (PyTorch ops) and return the world communicator."""
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(int(config.stall_warning_s)))
    if config.stall_timeout_s:
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(int(config.stall_timeout_s)))
    launch = detect_launcher()
    if launch is not None and launch.uses_mpi:
        # Under an MPI launcher MPI starts here, before Horovod: then Horovod's shutdown (coordinated
        # across ranks, in its background thread) does not finalize MPI under the leaving notices
        # (departures.py); mpi4py finalizes it at exit, after hpctrain's shutdown.
        try:
            from mpi4py import MPI  # noqa: F401
        except ImportError:
            pass
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the horovod backend needs Horovod built with PyTorch support ({exc}); "
            f"run `make setup` (scripts/install_horovod.sh) or use backend='mpi'") from exc
    # HOROVOD_TIMELINE is hpctrain.horovod's (per-tensor rows of what hpctrain runs); the Horovod underneath
    # would write its own file at the same path, so it does not see the variable.
    timeline = os.environ.pop("HOROVOD_TIMELINE", None)
    try:
        hvd.init(process_sets="dynamic")
    finally:
        if timeline is not None:
            os.environ["HOROVOD_TIMELINE"] = timeline

    topo = Topology(hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    runtime = Runtime(config, hvd.rank(), abort_job, departures=_departures(hvd))
    registry = {tuple(range(hvd.size())): hvd.global_process_set}  # Horovod refuses a duplicate
    return Communicator(HorovodBackend(runtime, hvd, hvd.global_process_set, "world", range(hvd.size()), topo,
                                       registry))


def _departures(hvd):
    """Where this world sends leaving notices: MPI under Horovod's MPI controller, else horovodrun's store."""
    from ..life.departures import Departures
    from .notices import KVNotices, MPINotices

    if hvd.size() == 1:
        return None
    if hvd.mpi_enabled():
        from mpi4py import MPI

        notices = MPINotices(MPI.COMM_WORLD, MPI)
        return Departures(notices.rank, notices.size, notices.poll, notices.announce, notices.free)
    addr, port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        return None        # no channel: a departure shows as Horovod's shutdown error, naming the call
    notices = KVNotices(addr, int(port), hvd.rank(), hvd.size())
    return Departures(notices.rank, notices.size, notices.poll, notices.announce)
