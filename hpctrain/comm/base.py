"""The Communicator interface: one entry point per collective, each with an async form.

A communicator validates a call, converts its input to a numpy buffer
(:mod:`hpctrain.tensors`), checks that all ranks make the same call
(:mod:`hpctrain.comm.call.signature`), runs the algorithm on numpy buffers and
converts the result back to the input's type.  The class is a facade over
parts it holds: a backend (MPI, Horovod, local: the buffer primitives of
:mod:`hpctrain.comm.backends.primitives`) and its runtime, the call path
(:mod:`hpctrain.comm.call.call_path`), the reductions
(:mod:`hpctrain.comm.ops.reductions`, algorithms chosen through
:mod:`hpctrain.collectives.registry`), the data-moving collectives
(:mod:`hpctrain.comm.ops.data_movement`) and point-to-point messages
(:mod:`hpctrain.comm.ops.point_to_point`, whose ``send``, ``recv``, ``probe``,
``recv_any``, ... are the communicator's).

Rules common to every collective:

* the result has the input's type (numpy, torch or TensorFlow), dtype and, for
  element-wise collectives, shape; the input is never modified;
* each ``name(...)`` has a ``name_async(...)`` twin returning a :class:`Handle`;
  calls run one at a time in the order they were made (see
  :mod:`hpctrain.comm.life.runtime`);
* with ``HPCTRAIN_CHECK`` on (the default) ranks first compare their calls, so
  a mismatch in kind, dtype, shape, op, root or algorithm, or an invalid
  argument on any rank, raises :class:`~hpctrain.errors.CollectiveMismatchError`
  on every rank instead of hanging or corrupting memory.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..collectives import registry
from ..collectives.adasum import adasum_allreduce
from .call.call_path import CallPath
from .ops.data_movement import Exchanges
from .call.repeated_calls import NOT_REPEATED
from .call.handle import Handle, CarriedByCheck, Topology, done_handle, same as _same
from .ops.point_to_point import PointToPoint
from .ops.reductions import Reductions
from .call.signature import Call
from .life.world_life import WorldLife

__all__ = ["Communicator", "Handle", "CarriedByCheck", "Topology", "done_handle"]


def _message(name: str):
    """The communicator's method ``name``: :class:`PointToPoint`'s, on the communicator's messages."""
    impl = getattr(PointToPoint, name)

    @functools.wraps(impl)
    def method(self, *args, **kwargs):
        return impl(self._messages, *args, **kwargs)
    return method


class Communicator:
    """A group of ranks that run collectives together, over ``backend`` (a
    :class:`~hpctrain.comm.backends.primitives.Primitives`: its rank, size, name, world ranks, topology and
    runtime are the communicator's).
    """

    bucket_strategy = "allreduce"       # how a gradient bucket is reduced over it (hpctrain.bucket_strategies)

    def __init__(self, backend):
        self._backend = backend
        self._rt = backend.runtime
        self.life = WorldLife(self._rt)     # the world's life as features see it: world_life.py
        self._rank, self._size = backend.rank, backend.size
        self.name, self.world_ranks, self.topology = backend.name, backend.world_ranks, backend.topology
        self.backend = backend.kind         # "mpi", "horovod" or "local"
        # the backend's optional capabilities (None where it has none): Horovod's named all-reduce, outside the
        # call check, and its all-gather of named byte blobs, for hpctrain.horovod's negotiation
        self.named_allreduce_async, self.gather_bytes = backend.named_allreduce_async, backend.gather_bytes
        self._seq = 0
        self._reductions = Reductions(self)
        self._exchanges = Exchanges(self)
        self._calls = CallPath(self)
        self._messages = PointToPoint(self)

    # point-to-point messages (their docs are PointToPoint's)
    send, send_async, recv, recv_async = _message("send"), _message("send_async"), _message("recv"), _message("recv_async")
    recv_bytes, probe, recv_any = _message("recv_bytes"), _message("probe"), _message("recv_any")

    # -- identity -------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self._rank

    @property
    def size(self) -> int:
        """The number of ranks in the communicator."""
        return self._size

    @property
    def config(self):
        """The settings this communicator runs with (a read-only :class:`~hpctrain.comm.life.runtime.Config`)."""
        return self._rt.config

    @property
    def comm_log(self):
        """This rank's log of collectives (a :class:`~hpctrain.comm.recording.comm_log.CommLog`, shared by the world's
        communicators): ``start()``, ``stop()``, ``rows()``, ``table()``; on from the start with HPCTRAIN_COMM_LOG=1."""
        return self._rt.comm_log

    @property
    def timeline(self):
        """This rank's timeline recorder (a :class:`~hpctrain.comm.recording.timeline.Timeline`, shared by the world's
        communicators): ``start()``, ``stop()``, ``span()``; on from the start with HPCTRAIN_TIMELINE=path.
        :func:`hpctrain.comm.recording.timeline.write_trace` merges the ranks' into one file."""
        return self._rt.timeline

    @property
    def mpi_comm(self):
        """The mpi4py communicator under this one on the MPI backend (what the survivors shrink after a failure),
        else None."""
        return self._backend.mpi_comm

    def __repr__(self) -> str:
        return f"<Communicator {self.backend} {self.name} rank {self._rank} of {self._size}>"

    # -- collectives ------------------------------------------------------
    def allreduce(self, x: Any, op: str = "sum", algorithm: str = "auto", inplace: bool = False) -> Any:
        """Return the element-wise reduction of ``x`` over all ranks.

        Formula: ``out = op(x_0, ..., x_{n-1})`` with op in sum, avg, min, max,
        prod; float16/bfloat16 stay 2 bytes a value between ranks, each pair added in float32 and rounded
        (:mod:`hpctrain.collectives.ops`: at most ``n - 1`` roundings).  ``algorithm``: "native"
        (the backend's library call), "ring" (hpctrain's bandwidth-optimal ring,
        ``2 (n-1)/n`` of the bytes sent per rank), on the MPI backend "shm"
        (one node: peers reduce straight from each other's memory, see
        :mod:`hpctrain.collectives.shm`) and "hierarchical" (shared memory on
        each node, a ring across nodes), or "auto" (by message size and
        topology; thresholds from ``hpctrain tune``).  Every algorithm gives
        bit-identical results on all ranks.

        ``inplace=True`` writes the result into ``x`` and returns ``x`` (a
        writable numpy array or torch tensor); for float32/float64/integer CPU
        buffers the reduction then runs in ``x``'s own memory, saving a copy and
        an allocation of the buffer's size.  Do not touch ``x`` until it is done.
        """
        out = self._calls.repeat(x, ("allreduce", op, algorithm, inplace))
        if out is not NOT_REPEATED:
            return out
        return self._calls.run(self._reductions.plan_allreduce(x, op, algorithm, inplace))

    def allreduce_async(self, x: Any, op: str = "sum", algorithm: str = "auto", inplace: bool = False) -> Handle:
        """Start :meth:`allreduce` and return a :class:`Handle`."""
        return self._calls.submit(self._reductions.plan_allreduce(x, op, algorithm, inplace))

    def grouped_allreduce(self, xs: Sequence[Any], op: str = "sum", algorithm: str = "auto",
                          inplace: bool = False) -> List[Any]:
        """Return the all-reduction of each tensor of ``xs``, fused into a few collectives.

        Tensors are grouped by dtype into fusion buffers of at most
        ``HPCTRAIN_FUSION_THRESHOLD`` bytes (see :mod:`hpctrain.collectives.fusion`)
        and each buffer is reduced with one collective; the results equal
        :meth:`allreduce` of each tensor (bit for bit with the "shm" algorithm).
        One call check covers the whole list: ranks that pass lists of
        different lengths, dtypes or shapes get an error naming them.
        ``inplace=True`` writes each result into its tensor.  Cost: one
        collective per buffer instead of one per tensor; the shared-memory
        algorithms read the tensors in place, others pack and unpack them
        (two extra copies of the bytes).
        """
        return self._calls.run(self._reductions.plan_grouped(xs, op, algorithm, inplace))

    def grouped_allreduce_async(self, xs: Sequence[Any], op: str = "sum", algorithm: str = "auto",
                                inplace: bool = False) -> Handle:
        """Start :meth:`grouped_allreduce`; the handle's ``wait()`` returns the list of results."""
        return self._calls.submit(self._reductions.plan_grouped(xs, op, algorithm, inplace))

    def allgather(self, x: Any, algorithm: str = "auto") -> Any:
        """Return the concatenation along dim 0 of every rank's ``x`` (dim 0 may differ per rank).

        Cost: each rank receives the sum of all inputs.  ``algorithm``: "native",
        "shm" (MPI backend, one node: through shared memory) or "auto" (shm on
        one node from ``shm_min_bytes`` of output, else native).
        """
        out = self._calls.repeat(x, ("allgather", algorithm))
        return out if out is not NOT_REPEATED else self._calls.run(self._exchanges.plan_allgather(x, algorithm))

    def allgather_async(self, x: Any, algorithm: str = "auto") -> Handle:
        """Start :meth:`allgather` and return a :class:`Handle`."""
        return self._calls.submit(self._exchanges.plan_allgather(x, algorithm))

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Return ``root``'s ``x`` on every rank (all ranks pass a tensor of the same shape and dtype)."""
        return self._calls.run(self._exchanges.plan_broadcast(x, root))

    def broadcast_async(self, x: Any, root: int = 0) -> Handle:
        """Start :meth:`broadcast` and return a :class:`Handle`."""
        return self._calls.submit(self._exchanges.plan_broadcast(x, root))

    def reduce_scatter(self, x: Any, op: str = "sum", algorithm: str = "auto") -> Any:
        """Reduce ``x`` over ranks and return this rank's block of rows.

        Dim 0 is split as ``numpy.array_split`` does: the first ``len(x) % n``
        ranks get one extra row.  Cost: ``(n-1)/n`` of the bytes sent per rank.
        """
        out = self._calls.repeat(x, ("reduce_scatter", op, algorithm))
        return out if out is not NOT_REPEATED else self._calls.run(self._reductions.plan_reduce_scatter(x, op, algorithm))

    def reduce_scatter_async(self, x: Any, op: str = "sum", algorithm: str = "auto") -> Handle:
        """Start :meth:`reduce_scatter` and return a :class:`Handle`."""
        return self._calls.submit(self._reductions.plan_reduce_scatter(x, op, algorithm))

    def alltoall(self, x: Any, splits: Optional[Sequence[int]] = None) -> Any:
        """Send rows ``x[off_i : off_i + splits[i]]`` to rank i; return the received rows, in rank order.

        Without ``splits`` dim 0 must divide evenly by the number of ranks.
        """
        return self._calls.run(self._exchanges.plan_alltoall(x, splits))

    def alltoall_async(self, x: Any, splits: Optional[Sequence[int]] = None) -> Handle:
        """Start :meth:`alltoall` and return a :class:`Handle`."""
        return self._calls.submit(self._exchanges.plan_alltoall(x, splits))

    def barrier(self) -> None:
        """Return when every rank has entered the barrier."""
        self._calls.run((Call("barrier", self._calls.next_seq()), self._backend.barrier, _same))

    def barrier_async(self) -> Handle:
        """Start :meth:`barrier` and return a :class:`Handle`."""
        return self._calls.submit((Call("barrier", self._calls.next_seq()), self._backend.barrier, _same))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return ``root``'s picklable ``obj`` on every rank (for small Python objects, not tensors)."""
        return self._calls.run(self._exchanges.plan_object("broadcast_object", obj, root))

    def broadcast_object_async(self, obj: Any, root: int = 0) -> Handle:
        """Start :meth:`broadcast_object` and return a :class:`Handle`."""
        return self._calls.submit(self._exchanges.plan_object("broadcast_object", obj, root))

    def allgather_object(self, obj: Any) -> List[Any]:
        """Return the list of every rank's picklable ``obj``, in rank order."""
        return self._calls.run(self._exchanges.plan_object("allgather_object", obj, None))

    def allgather_object_async(self, obj: Any) -> Handle:
        """Start :meth:`allgather_object` and return a :class:`Handle`."""
        return self._calls.submit(self._exchanges.plan_object("allgather_object", obj, None))

    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Return the sub-communicator of the ranks that passed the same ``color``, ordered by ``key``.

        A rank that passes ``color=None`` takes part but gets None.  Collective.
        """
        return self._calls.run(self._exchanges.plan_split(color, key))

    def shared_empty(self, count: int, dtype: Any = np.float32) -> np.ndarray:
        """Return an uninitialised 1-D buffer whose in-place all-reduce copies nothing in or out.

        Collective: every rank calls it with the same count and dtype.  On
        the MPI backend with several ranks on a node the buffer lives in a
        shared-memory window of the node, so ``allreduce(buf, inplace=True)``
        (algorithm "shm"/"hierarchical", or "auto" choosing them) reduces
        straight from the peers' buffers into every rank's: one memory pass
        each way instead of a copy into the shared arena, the arena algorithm
        and a copy out.  Elsewhere it is ``numpy.empty``.  Wrap it with
        ``torch.from_numpy`` to use it as a tensor.  It stays valid until the
        communicator is freed (``hpctrain.shutdown()`` for the world).
        """
        return self._calls.run(self._exchanges.plan_shared_empty(count, dtype))

    def abort(self, message: str, code: int = 1) -> None:
        """Print ``message`` and end the whole job on every rank with status ``code`` (never returns; see
        :mod:`hpctrain.comm.life.abort`)."""
        self._rt.abort(message, code)

    def on_close(self, callback: Callable[..., object], what: str, owner: Optional[object] = None
                 ) -> Callable[[], None]:
        """Run ``callback`` when the world closes (``hpctrain.shutdown()``, or at exit), before this rank leaves.

        ``what`` names it in the error if it fails.  Callbacks run last added
        first, on every rank, so collectives inside them meet; one that fails
        does not stop the others (see :meth:`Runtime.close`).  With an
        ``owner``, held weakly, it is ``callback(owner)`` until the owner is
        dropped (:class:`~hpctrain.hooks.Hooks`).
        Returns a function that takes the callback back.
        """
        return self.life.on_close(callback, what, owner)

    def on_rank_failure(self, handler: Callable[..., None], owner: Optional[object] = None) -> Callable[[], None]:
        """Let the job go on when ranks fail: ``handler(failed world ranks)`` instead of the abort (or, in
        elastic mode, the re-forming); return a function that restores those.

        The watchdog calls ``handler`` with every failed rank known, each time
        more are (within its period); it may end the job itself
        (:meth:`abort`).  Collectives that include a failed rank can no longer
        complete: what goes on talks point to point (:meth:`recv_any`), as a
        parameter server does.  Needs MPI's fault-tolerance extension
        (``hpctrain launch --elastic``); without it a failed rank ends the job.
        At shutdown the failed ranks are not waited for.  With an ``owner``,
        held weakly, it is ``handler(owner, failed)`` and ends when the owner
        is dropped (the shape of every callback on the world's life).
        """
        return self.life.tolerate(handler, owner)

    def on_interrupt(self, describe: Callable[..., str], owner: Optional[object] = None) -> Callable[[], None]:
        """Have rank 0 print ``describe()`` when a KeyboardInterrupt (Ctrl-C) ends the job; return a remover.

        For what survives an interruption: a checkpoint manager says which
        step is committed.  With an ``owner``, held weakly, it is
        ``describe(owner)`` (:class:`~hpctrain.hooks.Hooks`).
        """
        return self.life.on_interrupt(describe, owner)

    def allgather_object_unchecked(self, obj: Any) -> List[Any]:
        """Every rank's ``obj`` through the backend's own all-gather, outside the call check (for the check of
        the settings that decide the call check itself)."""
        return self._backend.allgather_object(obj)

    def close(self, exit_status: int = 0) -> None:
        """Finish the queued calls, leave (see :mod:`hpctrain.comm.life.departures`), free the node's shared memory.

        ``exit_status``: the status this process is about to exit with, told to the other ranks as it leaves.
        """
        try:
            self._rt.close(exit_status)
        finally:
            self._backend.release_shared()

    def free(self) -> None:
        """Release the backend resources of this communicator (not of the world)."""
        self._reductions.forget()       # (its repeat paths hold the backend's shared memory)
        self._backend.free()

    def adasum_allreduce(self, x: np.ndarray, segments: Sequence[int]) -> np.ndarray:
        """The Adasum of every rank's ``x`` (tensors of ``segments`` lengths combined each on its own; see
        :func:`hpctrain.collectives.adasum.adasum_allreduce`)."""
        return adasum_allreduce(self, x, segments)

    # -- algorithms ---------------------------------------------------------
    def allreduce_algorithms(self) -> Tuple[str, ...]:
        """Return the names ``allreduce(algorithm=...)`` takes on this backend: "auto" and the registered ones."""
        return ("auto",) + tuple(a.name for a in registry.algorithms("allreduce", self.backend))

    def allreduce_algorithm(self, nbytes: int) -> str:
        """Return the algorithm ``allreduce(algorithm="auto")`` runs here for a buffer of ``nbytes`` bytes.

        Where ``auto`` measures (:mod:`hpctrain.comm.call.measured_choice`), this is
        "shm" until the size class has been measured, then the faster way.
        """
        red, nbytes = self._reductions, int(nbytes)
        name = registry.choose("allreduce", red.where(), nbytes).name
        faster = red.measured.own_is_faster("allreduce", nbytes) if red.measuring("auto", name, nbytes) else None
        return "native" if faster is False else name
