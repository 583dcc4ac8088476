"""The Communicator interface: one entry point per collective, each with an async form.

A communicator validates a call, converts its input to a numpy buffer
(:mod:`hpctrain.tensors`), checks that all ranks make the same call
(:mod:`hpctrain.comm.signature`), runs the algorithm on numpy buffers and
converts the result back to the input's type.  Backends (MPI, Horovod, local)
implement only the small set of buffer primitives at the bottom of this
class; everything above them is shared.

Rules common to every collective:

* the result has the input's type (numpy, torch or TensorFlow), dtype and, for
  element-wise collectives, shape; the input is never modified;
* each ``name(...)`` has a ``name_async(...)`` twin returning a :class:`Handle`;
  calls run one at a time in the order they were made (see
  :mod:`hpctrain.comm.runtime`);
* with ``HPCTRAIN_CHECK`` on (the default) ranks first compare their calls, so
  a mismatch in kind, dtype, shape, op, root or algorithm, or an invalid
  argument on any rank, raises :class:`~hpctrain.errors.CollectiveMismatchError`
  on every rank instead of hanging or corrupting memory.
"""
from __future__ import annotations

import abc
import zlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..collectives.fusion import FusionBuffers, fusion_groups
from ..collectives.ops import accumulation_dtype, check_op, finish, segment_bounds, to_accumulator
from ..collectives.results import ResultBuffers
from ..collectives import registry
from ..collectives.shm import Flat
from ..errors import CollectiveMismatchError
from ..tensors import dtype_name, framework_of, to_numpy
from .runtime import Runtime
from .handle import Handle, Riding, Topology, done_handle, same as _same
from .links import Links
from .signature import Call

__all__ = ["Communicator", "Handle", "Riding", "Topology", "done_handle"]

Plan = Tuple[Call, Optional[Callable[[], Any]], Callable[[Any], Any]]


def _copy_back_into(x: Any, arr: np.ndarray, restore: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Return a restore function that leaves the result in ``x`` (``arr`` is x's numpy form) and returns ``x``.

    Raises ValueError (at planning time, so every rank hears of it) when ``x``
    cannot be written: TensorFlow tensors, read-only or non-contiguous arrays.
    """
    kind = framework_of(x)
    if kind == "tensorflow":
        raise ValueError("allreduce(inplace=True) cannot write into a TensorFlow tensor (they are immutable)")
    if kind == "numpy" and not (isinstance(x, np.ndarray) and x.flags.writeable
                                and (x.size == 0 or np.may_share_memory(arr, x))):
        raise ValueError("allreduce(inplace=True) needs a writable C-contiguous numpy array")

    view = kind == "numpy" or (x.device.type == "cpu" and x.is_contiguous())  # is ``arr`` x's memory?

    def into(result: np.ndarray) -> Any:
        if not (view and np.may_share_memory(result, arr)):
            if kind == "numpy":
                np.copyto(x, result.reshape(x.shape))
            else:
                x.copy_(restore(result).view(x.shape))   # torch on CUDA, or a widened dtype
        return x
    return into


class Communicator(abc.ABC):
    """A group of ranks that run collectives together.

    Args:
        runtime: shared settings, engine and watchdog of the world.
        rank: this process's rank in the group.
        size: the number of ranks in the group.
        name: a label for messages ("world", "world.split(1)").
        world_ranks: the world rank of each member, in group order.
        topology: node layout of this process.
    """

    backend = "abstract"

    def __init__(self, runtime: Runtime, rank: int, size: int, name: str,
                 world_ranks: Sequence[int], topology: Topology):
        self._rt = runtime
        self._rank = rank
        self._size = size
        self.name = name
        self.world_ranks = tuple(world_ranks)
        self.topology = topology
        self._seq = 0
        self._fusion = FusionBuffers()
        self._seen_allreduce: dict = {}     # (dtype, shape, op, algorithm) -> (checked call, algorithm, lean path)
        self._seen_grouped: dict = {}       # (op, algorithm, dtypes and shapes) -> grouped_allreduce's plan
        self._results = ResultBuffers()     # memory of large results, reused once the caller drops them
        self._algorithms: dict = {}         # name -> registry.Algorithm, as chosen here before
        self._links = Links(self)
        registry.on_change(self._forget_choices)

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
        """The settings this communicator runs with (a read-only :class:`~hpctrain.comm.runtime.Config`)."""
        return self._rt.config

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} rank {self._rank} of {self._size}>"

    # -- collectives ------------------------------------------------------
    def allreduce(self, x: Any, op: str = "sum", algorithm: str = "auto", inplace: bool = False) -> Any:
        """Return the element-wise reduction of ``x`` over all ranks.

        Formula: ``out = op(x_0, ..., x_{n-1})`` with op in sum, avg, min, max,
        prod; float16/bfloat16 accumulate in float32.  ``algorithm``: "native"
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
        if type(x) is np.ndarray and not inplace:     # a repeated small call: the backend's lean path
            seen = self._seen_allreduce.get((x.dtype, x.shape, op, algorithm))
            if seen is not None and seen[2] is not None and x.flags.c_contiguous:
                return seen[2](x)
        return self._run(self._plan_allreduce(x, op, algorithm, inplace))

    def allreduce_async(self, x: Any, op: str = "sum", algorithm: str = "auto", inplace: bool = False) -> Handle:
        """Start :meth:`allreduce` and return a :class:`Handle`."""
        return self._submit(self._plan_allreduce(x, op, algorithm, inplace))

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
        return self._run(self._plan_grouped(xs, op, algorithm, inplace))

    def grouped_allreduce_async(self, xs: Sequence[Any], op: str = "sum", algorithm: str = "auto",
                                inplace: bool = False) -> Handle:
        """Start :meth:`grouped_allreduce`; the handle's ``wait()`` returns the list of results."""
        return self._submit(self._plan_grouped(xs, op, algorithm, inplace))

    def allgather(self, x: Any, algorithm: str = "auto") -> Any:
        """Return the concatenation along dim 0 of every rank's ``x`` (dim 0 may differ per rank).

        Cost: each rank receives the sum of all inputs.  ``algorithm``: "native",
        "shm" (MPI backend, one node: through shared memory) or "auto" (shm on
        one node from ``shm_min_bytes`` of output, else native).
        """
        return self._run(self._plan_allgather(x, algorithm))

    def allgather_async(self, x: Any, algorithm: str = "auto") -> Handle:
        """Start :meth:`allgather` and return a :class:`Handle`."""
        return self._submit(self._plan_allgather(x, algorithm))

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Return ``root``'s ``x`` on every rank (all ranks pass a tensor of the same shape and dtype)."""
        return self._run(self._plan_broadcast(x, root))

    def broadcast_async(self, x: Any, root: int = 0) -> Handle:
        """Start :meth:`broadcast` and return a :class:`Handle`."""
        return self._submit(self._plan_broadcast(x, root))

    def reduce_scatter(self, x: Any, op: str = "sum", algorithm: str = "auto") -> Any:
        """Reduce ``x`` over ranks and return this rank's block of rows.

        Dim 0 is split as ``numpy.array_split`` does: the first ``len(x) % n``
        ranks get one extra row.  Cost: ``(n-1)/n`` of the bytes sent per rank.
        """
        return self._run(self._plan_reduce_scatter(x, op, algorithm))

    def reduce_scatter_async(self, x: Any, op: str = "sum", algorithm: str = "auto") -> Handle:
        """Start :meth:`reduce_scatter` and return a :class:`Handle`."""
        return self._submit(self._plan_reduce_scatter(x, op, algorithm))

    def alltoall(self, x: Any, splits: Optional[Sequence[int]] = None) -> Any:
        """Send rows ``x[off_i : off_i + splits[i]]`` to rank i; return the received rows, in rank order.

        Without ``splits`` dim 0 must divide evenly by the number of ranks.
        """
        return self._run(self._plan_alltoall(x, splits))

    def alltoall_async(self, x: Any, splits: Optional[Sequence[int]] = None) -> Handle:
        """Start :meth:`alltoall` and return a :class:`Handle`."""
        return self._submit(self._plan_alltoall(x, splits))

    def barrier(self) -> None:
        """Return when every rank has entered the barrier."""
        self._run(self._plan(Call("barrier", self._next_seq()), self._barrier))

    def barrier_async(self) -> Handle:
        """Start :meth:`barrier` and return a :class:`Handle`."""
        return self._submit(self._plan(Call("barrier", self._next_seq()), self._barrier))

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Return ``root``'s picklable ``obj`` on every rank (for small Python objects, not tensors)."""
        return self._run(self._plan_object("broadcast_object", obj, root))

    def broadcast_object_async(self, obj: Any, root: int = 0) -> Handle:
        """Start :meth:`broadcast_object` and return a :class:`Handle`."""
        return self._submit(self._plan_object("broadcast_object", obj, root))

    def allgather_object(self, obj: Any) -> List[Any]:
        """Return the list of every rank's picklable ``obj``, in rank order."""
        return self._run(self._plan_object("allgather_object", obj, None))

    def allgather_object_async(self, obj: Any) -> Handle:
        """Start :meth:`allgather_object` and return a :class:`Handle`."""
        return self._submit(self._plan_object("allgather_object", obj, None))

    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Send ``x`` to rank ``dest`` (its shape and dtype travel with it); return when it may be reused."""
        self.send_async(x, dest, tag).wait()

    def send_async(self, x: Any, dest: int, tag: int = 0, header: bool = True, copy: bool = True) -> Handle:
        """Start sending ``x`` (a copy, unless ``copy=False``) to ``dest``; return a :class:`Handle` (like MPI_Isend).

        With ``header=False`` only the bytes travel (one message, no dtype or
        shape): the receiver takes them with :meth:`recv_bytes` and must know
        what they are.  For repeated messages of a known layout (pipeline
        activations); cost is one message of ``x.nbytes`` instead of two.

        With ``copy=False`` a CPU array or tensor is sent from its own memory
        (no copy of ``x.nbytes``): the caller must not modify it until the
        handle's ``wait()`` returns; the handle keeps it alive.  (A one-rank
        communicator copies anyway: its message is the array it delivers.)
        """
        arr, _ = to_numpy(x)
        self._check_peer(dest, "dest")
        if copy or self._size == 1:
            arr = np.array(arr, copy=True, order="C")
        if header:
            return self._isend(arr, int(dest), int(tag))
        return self._isend_bytes(arr.reshape(-1).view(np.uint8), int(dest), int(tag))

    def recv(self, source: int, tag: int = 0, like: Any = None) -> Any:
        """Receive what rank ``source`` sent with ``tag``; a numpy array, or ``like``'s type if given.

        Runs on the caller's thread, after the receives started before it with
        :meth:`recv_async`: no hand-off to the receive thread (two thread
        switches a message saved).
        """
        restore = to_numpy(like)[1] if like is not None else _same
        return restore(self._rt.receives.run(*self._recv_call(source, tag)))

    def recv_async(self, source: int, tag: int = 0, like: Any = None) -> Handle:
        """Start :meth:`recv` and return a :class:`Handle`; receives complete in the order they were posted."""
        restore = to_numpy(like)[1] if like is not None else _same
        return Handle(self._rt.receives.submit(*self._recv_call(source, tag)), restore)

    def _recv_call(self, source: int, tag: int):
        """The receive of (``source``, ``tag``) as the receive lane takes it: ``(call, text for the watchdog)``."""
        self._check_peer(source, "source")
        return (lambda: self._recv(int(source), int(tag))), f"recv from rank {source} (tag {tag}) on {self.name}"

    def recv_bytes(self, source: int, tag: int = 0) -> np.ndarray:
        """Receive a message sent with ``send_async(..., header=False)``: its bytes, as a flat uint8 array."""
        self._check_peer(source, "source")
        text = f"recv of bytes from rank {source} (tag {tag}) on {self.name}"
        return self._rt.receives.run(lambda: self._recv_bytes(int(source), int(tag)), text)

    def split(self, color: Optional[int], key: int = 0) -> Optional["Communicator"]:
        """Return the sub-communicator of the ranks that passed the same ``color``, ordered by ``key``.

        A rank that passes ``color=None`` takes part but gets None.  Collective.
        """
        def build(seq):
            if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
                raise ValueError(f"split color must be a non-negative int or None, got {color!r}")
            if not isinstance(key, (int, np.integer)):
                raise ValueError(f"split key must be an int, got {key!r}")
            return Call("split", seq), lambda: self._split(color, int(key)), _same
        return self._run(self._build("split", build))

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
        def build(seq):
            dt = np.dtype(dtype)
            if not isinstance(count, (int, np.integer)) or count < 0:
                raise ValueError(f"count must be a non-negative int, got {count!r}")
            return Call("shared_empty", seq, str(dt), (int(count),)), lambda: self._shared_empty(int(count), dt), _same
        return self._run(self._build("shared_empty", build))

    def abort(self, message: str) -> None:
        """Print ``message`` and end the whole job on every rank (never returns; see :mod:`hpctrain.comm.abort`)."""
        self._rt.abort(message)

    def close(self) -> None:
        """Finish the queued calls, stop the engine and release the node's shared memory (``hpctrain.shutdown()``).

        For the world communicator, which owns the engine; collective.
        """
        self._rt.close()
        self._release_shared()

    def free(self) -> None:
        """Release the backend resources of this communicator (not of the world)."""
        self._seen_allreduce.clear()       # (its lean paths hold the backend's shared memory)
        self._free()

    # -- planning: validate, describe, bind the work ----------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _plan(self, call: Call, work: Callable[[], Any], restore=_same) -> Plan:
        return call, work, restore

    def _build(self, kind: str, build: Callable[[int], Plan], **hints) -> Plan:
        """Run ``build(seq)``; an invalid argument becomes part of the call so every rank hears of it."""
        seq = self._next_seq()
        try:
            return build(seq)
        except (TypeError, ValueError) as exc:
            if not self._rt.config.check or self._size == 1:
                raise
            return Call(kind, seq, error=f"{type(exc).__name__}: {exc}", **hints), None, _same

    def _run(self, plan: Plan) -> Any:
        call, work, restore = plan
        return restore(self._rt.run(self._task(call, work), lambda: f"{call.text()} #{call.seq} on {self.name}"))

    def _submit(self, plan: Plan) -> Handle:
        call, work, restore = plan
        return Handle(self._rt.submit(self._task(call, work), lambda: f"{call.text()} #{call.seq} on {self.name}"),
                      restore)

    def _task(self, call: Call, work: Optional[Callable[[], Any]]) -> Callable[[], Any]:
        riding = work if isinstance(work, Riding) else None

        def task():
            if self._size > 1 and (self._rt.config.check or riding is not None):
                verdict = self._exchange_calls(call, riding)
                if verdict:
                    raise CollectiveMismatchError(verdict)
                self._rt.note_waiting("all ranks joined; the data transfer has not finished")
            return riding.finish() if riding is not None else work()
        return task

    def _choose_allreduce(self, algorithm: str, nbytes: int) -> str:
        """Return the name of the all-reduce algorithm to run (``auto``: the registry's cheapest here)."""
        where = self._where()
        if algorithm == "auto":
            chosen = registry.choose("allreduce", where, nbytes)
        else:
            chosen = registry.lookup("allreduce", algorithm)
            if chosen is None or not chosen.runs_on(self.backend):
                raise ValueError(f"unknown algorithm {algorithm!r} for the {self.backend} backend; "
                                 f"expected one of {', '.join(self.allreduce_algorithms())}")
            why = chosen.refusal(where, self.name)
            if why:
                raise ValueError(why)
        self._algorithms[chosen.name] = chosen
        return chosen.name

    def _forget_choices(self) -> None:
        """Drop the remembered plans of repeated calls (the registered algorithms changed)."""
        self._seen_allreduce.clear()
        self._seen_grouped.clear()

    def _shared_alg(self, alg: str) -> bool:
        """Return True if ``alg`` (chosen here before) runs on the backend's shared memory."""
        return self._algorithms[alg].shared_memory

    def _plan_allreduce(self, x, op, algorithm, inplace=False) -> Plan:
        # A training loop repeats a few calls: a C-contiguous numpy input of a dtype, shape, op and
        # algorithm seen before skips the checks it passed then (they depend on nothing else).
        seen = (type(x) is np.ndarray and not inplace and x.flags.c_contiguous
                and self._seen_allreduce.get((x.dtype, x.shape, op, algorithm)))
        if seen:
            call, alg, _ = seen
            return call.at(self._next_seq()), self._allreduce_work(x, op, alg, False), _same

        def build(seq):
            arr, restore = to_numpy(x)
            check_op(op, arr.dtype)
            alg = self._choose_allreduce(algorithm, arr.nbytes)
            shared = (inplace and self._shared_alg(alg) and self._size > 1 and arr.size > 0
                      and accumulation_dtype(arr.dtype) == arr.dtype and self._shared_buffer_of(arr) is not None)
            call = Call("allreduce", seq, dtype_name(arr.dtype), arr.shape, op=op, algorithm=alg,
                        layout="shared buffer" if shared else None)
            if inplace:
                restore = _copy_back_into(x, arr, restore)
            if shared:    # (a small one rides along with the call check: one exchange, no fences)
                riding = self._riding_allreduce(arr, op, alg, True)
                return call, riding or (lambda: self._allreduce_shared_buffer(arr, op)), restore
            if type(x) is np.ndarray and not inplace and x.flags.c_contiguous:
                if len(self._seen_allreduce) > 256:
                    self._seen_allreduce.clear()
                self._seen_allreduce[(x.dtype, x.shape, op, algorithm)] = (call, alg,
                                                                           self._lean_allreduce(call, arr, op, alg))
            return call, self._allreduce_work(arr, op, alg, inplace), restore
        return self._build("allreduce", build, op=op, algorithm=algorithm)

    def _allreduce_work(self, arr: np.ndarray, op: str, alg: str, inplace: bool):
        riding = self._riding_allreduce(arr, op, alg, inplace) if self._shared_alg(alg) and self._size > 1 else None
        return riding if riding is not None else (lambda: self._do_allreduce(arr, op, alg, inplace))

    def _do_allreduce(self, arr: np.ndarray, op: str, alg: str, inplace: bool = False) -> np.ndarray:
        same = inplace and accumulation_dtype(arr.dtype) == arr.dtype
        if self._shared_alg(alg) and self._size > 1 and arr.size:
            # in place, the result goes straight into ``arr``: its parts are read before they are written
            acc = self._shared_reduction(arr, op, alg, into=arr.reshape(-1) if same else None)
            return finish(acc, op, self._size, arr.dtype).reshape(arr.shape)
        acc = arr.reshape(-1) if same else self._accumulator(arr)
        if self._size > 1 and acc.size:
            acc = self._algorithms[alg].run(self._links, acc, op)
        return finish(acc, op, self._size, arr.dtype).reshape(arr.shape)

    def _allreduce_shared_buffer(self, arr: np.ndarray, op: str) -> np.ndarray:
        """In-place all-reduce of a buffer from :meth:`shared_empty`: no copies in or out (see its docstring)."""
        self._reduce_shared_buffer(self._shared_buffer_of(arr), op)
        return finish(arr.reshape(-1), op, self._size, arr.dtype).reshape(arr.shape)

    def _accumulator(self, arr: np.ndarray) -> np.ndarray:
        """Return a copy of ``arr``, flat, in its accumulation dtype, in memory from the result pool."""
        acc = self._results.empty(arr.size, accumulation_dtype(arr.dtype))
        np.copyto(acc, arr.reshape(-1), casting="unsafe")
        return acc

    def _shared_reduction(self, arr: np.ndarray, op: str, alg: str,
                          into: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the "shm"/"hierarchical" reduction of ``arr``: a flat accumulation-dtype array (``into`` if given)."""
        acc = self._results.empty(arr.size, accumulation_dtype(arr.dtype)) if into is None else into
        self._allreduce_shared(Flat([arr]), Flat([acc]), op, alg)
        return acc

    def _plan_grouped(self, xs, op, algorithm, inplace) -> Plan:
        def build(seq):
            if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
                raise TypeError(f"grouped_allreduce needs a list of tensors, got {type(xs).__name__}")
            items = list(xs)
            converted = [to_numpy(x) for x in items]
            arrs = [a for a, _ in converted]
            # a training loop repeats one list: its plan depends only on the dtypes, shapes, op and algorithm
            key = (op, algorithm, tuple((a.dtype, a.shape) for a in arrs))
            plan = self._seen_grouped.get(key)
            if plan is None:
                dtype_set = {a.dtype for a in arrs}
                for d in dtype_set:
                    check_op(op, d)
                groups = fusion_groups(arrs, self._rt.config.fusion_threshold)
                algs = [self._choose_allreduce(algorithm, g.numel * arrs[g.members[0]].itemsize) for g in groups]
                shapes = repr([(a.dtype.str, a.shape) for a in arrs]).encode()
                plan = (groups, algs, "+".join(sorted(str(d) for d in dtype_set)), sum(a.size for a in arrs),
                        f"{len(arrs)} tensors/{zlib.crc32(shapes):08x}")
                if len(self._seen_grouped) > 64:
                    self._seen_grouped.clear()
                self._seen_grouped[key] = plan
            groups, algs, dtypes, total, layout = plan
            call = Call("grouped_allreduce", seq, dtypes, (total,), op=op, algorithm=algorithm, layout=layout)
            restores = [_copy_back_into(x, a, r) if inplace else r for x, (a, r) in zip(items, converted)]
            return (call, lambda: self._do_grouped(arrs, groups, algs, op),
                    lambda outs: [r(o) for r, o in zip(restores, outs)])
        return self._build("grouped_allreduce", build, op=op, algorithm=algorithm)

    def _do_grouped(self, arrs: List[np.ndarray], groups, algs: List[str], op: str) -> List[np.ndarray]:
        outs: List[Optional[np.ndarray]] = [None] * len(arrs)
        for g, alg in zip(groups, algs):
            dtype = arrs[g.members[0]].dtype
            if self._shared_alg(alg) and self._size > 1:
                # the results are views of one buffer from the result pool: no page faults once it is warm,
                # and the buffer is reused only when the caller has dropped all of them
                acc = self._results.empty(g.numel, accumulation_dtype(dtype))
                self._allreduce_shared(Flat([arrs[i] for i in g.members]), Flat([acc]), op, alg)
                for i, off, n in zip(g.members, g.offsets, g.numels):
                    outs[i] = finish(acc[off:off + n], op, self._size, dtype).reshape(arrs[i].shape)
                continue
            flat = self._do_allreduce(self._fusion.pack(arrs, g), op, alg, inplace=True)
            for i, off, n in zip(g.members, g.offsets, g.numels):
                outs[i] = flat[off:off + n].reshape(arrs[i].shape).copy()
        return outs

    def _plan_allgather(self, x, algorithm="auto") -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            if arr.ndim == 0:
                raise ValueError("allgather needs a tensor with at least one dimension (it concatenates on dim 0)")
            shm = registry.lookup("allreduce", "shm")      # (the same shared memory gathers as well)
            valid = ("auto", "native") + (("shm",) if shm is not None and shm.runs_on(self.backend) else ())
            if algorithm not in valid:
                raise ValueError(f"unknown allgather algorithm {algorithm!r} for the {self.backend} backend; "
                                 f"expected one of {', '.join(valid)}")
            if algorithm == "shm" and shm.refusal(self._where(), self.name):
                raise ValueError(shm.refusal(self._where(), self.name))
            call = Call("allgather", seq, dtype_name(arr.dtype), arr.shape, algorithm=algorithm, free_dim0=True)
            return call, lambda: self._do_allgather(arr, algorithm), restore
        return self._build("allgather", build, algorithm=algorithm)

    def _do_allgather(self, arr: np.ndarray, algorithm: str = "auto") -> np.ndarray:
        rows = self._allgather_ints(arr.shape[0])
        row_bytes = arr.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
        counts = [r * row_bytes for r in rows]
        raw = None
        if algorithm == "shm" or (algorithm == "auto" and sum(counts) >= self._rt.config.shm_min_bytes):
            raw = self._allgather_shared(_bytes_of(arr), counts)     # (None where the backend has none)
        if raw is None:
            raw = self._allgatherv(_bytes_of(arr), counts)
        return raw.view(arr.dtype).reshape((sum(rows),) + arr.shape[1:])

    def _plan_broadcast(self, x, root) -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            self._check_root(root)
            call = Call("broadcast", seq, dtype_name(arr.dtype), arr.shape, root=root)
            return call, lambda: self._do_broadcast(arr, root), restore
        return self._build("broadcast", build, root=root)

    def _do_broadcast(self, arr: np.ndarray, root: int) -> np.ndarray:
        out = np.array(arr, copy=True, order="C")
        if self._size > 1 and out.size:
            self._broadcast(_bytes_of(out), root)
        return out

    def _plan_reduce_scatter(self, x, op, algorithm) -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            if arr.ndim == 0:
                raise ValueError("reduce_scatter needs a tensor with at least one dimension (it splits dim 0)")
            check_op(op, arr.dtype)
            alg = self._choose_allreduce(algorithm, arr.nbytes)
            call = Call("reduce_scatter", seq, dtype_name(arr.dtype), arr.shape, op=op, algorithm=alg)
            return call, lambda: self._do_reduce_scatter(arr, op, alg), restore
        return self._build("reduce_scatter", build, op=op, algorithm=algorithm)

    def _do_reduce_scatter(self, arr: np.ndarray, op: str, alg: str) -> np.ndarray:
        n, r = self._size, self._rank
        row = int(np.prod(arr.shape[1:], dtype=np.int64))
        rows = segment_bounds(arr.shape[0], n)
        bounds = rows * row
        if self._shared_alg(alg) and n > 1 and arr.size:
            if alg == "shm":
                acc = self._reduce_scatter_shared(arr.reshape(-1), bounds, accumulation_dtype(arr.dtype), op)
            else:   # hierarchical: the full reduction, then the own block
                acc = self._shared_reduction(arr, op, alg)[bounds[r]:bounds[r + 1]]
            out = finish(acc, op, n, arr.dtype)
            return out.reshape((int(rows[r + 1] - rows[r]),) + arr.shape[1:])
        acc = to_accumulator(arr)
        if n > 1 and acc.size:
            algorithm = self._algorithms[alg]
            if algorithm.reduce_scatter is not None:
                acc = algorithm.reduce_scatter(self._links, acc, bounds, op)
            else:     # the full all-reduce, then the own block
                acc = algorithm.run(self._links, acc, op)[bounds[r]:bounds[r + 1]]
        else:
            acc = acc[bounds[r]:bounds[r + 1]]
        out = finish(acc, op, n, arr.dtype)
        return out.reshape((int(rows[r + 1] - rows[r]),) + arr.shape[1:])

    def _plan_alltoall(self, x, splits) -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            if arr.ndim == 0:
                raise ValueError("alltoall needs a tensor with at least one dimension (it splits dim 0)")
            send = self._check_splits(arr.shape[0], splits)
            call = Call("alltoall", seq, dtype_name(arr.dtype), arr.shape, free_dim0=True)
            return call, lambda: self._do_alltoall(arr, send), restore
        return self._build("alltoall", build)

    def _check_splits(self, rows: int, splits) -> List[int]:
        n = self._size
        if splits is None:
            if rows % n:
                raise ValueError(f"alltoall without splits needs dim 0 ({rows}) divisible by the {n} ranks")
            return [rows // n] * n
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
        if len(splits) != n or min(splits) < 0 or sum(splits) != rows:
            raise ValueError(f"alltoall splits {splits} must be {n} non-negative counts summing to dim 0 ({rows})")
        return splits

    def _do_alltoall(self, arr: np.ndarray, send: List[int]) -> np.ndarray:
        recv = self._alltoall_ints(send)
        row_bytes = arr.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
        raw = self._alltoallv(_bytes_of(arr), [s * row_bytes for s in send], [s * row_bytes for s in recv])
        return raw.view(arr.dtype).reshape((sum(recv),) + arr.shape[1:])

    def _plan_object(self, kind: str, obj: Any, root: Optional[int]) -> Plan:
        def build(seq):
            if root is not None:
                self._check_root(root)
            if kind == "broadcast_object":
                return Call(kind, seq, root=root), lambda: self._broadcast_object(obj, root), _same
            return Call(kind, seq), lambda: self._allgather_object(obj), _same
        return self._build(kind, build, root=root)

    def _check_root(self, root) -> None:
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self._size:
            raise ValueError(f"root {root!r} is not a rank of {self.name} (size {self._size})")

    def _check_peer(self, peer, what) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self._size:
            raise ValueError(f"{what} {peer!r} is not a rank of {self.name} (size {self._size})")

    def _chunk_elems(self, itemsize: int) -> int:
        return max(1, self._rt.config.ring_chunk_bytes // max(1, itemsize))

    # -- what a backend provides (numpy buffers only) ----------------------
    def allreduce_algorithms(self) -> Tuple[str, ...]:
        """Return the names ``allreduce(algorithm=...)`` takes on this backend: "auto" and the registered ones."""
        return ("auto",) + tuple(a.name for a in registry.algorithms("allreduce", self.backend))

    def allreduce_algorithm(self, nbytes: int) -> str:
        """Return the algorithm ``allreduce(algorithm="auto")`` runs here for a buffer of ``nbytes`` bytes."""
        return registry.choose("allreduce", self._where(), int(nbytes)).name

    def _where(self) -> registry.Where:
        """What choosing an algorithm here depends on (see :class:`hpctrain.collectives.registry.Where`)."""
        return registry.Where(self.backend, self._size, self.topology.num_nodes, self._no_shared_memory(),
                              self._rt.config)

    def _no_shared_memory(self) -> str:
        """Return why the ranks of a node cannot share memory windows here ("" if they can)."""
        return f"the {self.backend} backend has no shared-memory windows"

    def _allreduce_shared(self, x: Flat, out: Flat, op: str, alg: str) -> None:
        """All-reduce ``x`` into ``out`` (accumulation dtype) with "shm" or "hierarchical"."""
        raise ValueError(f"the {self.backend} backend has no shared-memory algorithms")

    def _reduce_scatter_shared(self, x: np.ndarray, bounds, acc_dtype, op: str) -> np.ndarray:
        """Return this rank's segment of the shared-memory reduction of flat ``x``."""
        raise ValueError(f"the {self.backend} backend has no shared-memory algorithms")

    def _allgather_shared(self, raw: np.ndarray, counts: List[int]) -> Optional[np.ndarray]:
        """Return the shared-memory all-gather of bytes, or None where it does not apply (several nodes)."""
        return None

    def _shared_empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def _shared_buffer_of(self, arr: np.ndarray):
        """The shared buffer that ``arr`` is (from :meth:`shared_empty`), or None."""
        return None

    def _reduce_shared_buffer(self, buf, op: str) -> None:
        raise NotImplementedError

    def _release_shared(self) -> None:
        """Free shared-memory resources (collective over the node)."""

    def _riding_allreduce(self, arr: np.ndarray, op: str, alg: str, inplace: bool) -> Optional[Riding]:
        """Return the all-reduce of ``arr`` as work riding along with the call check, or None where it cannot."""
        return None

    def _lean_allreduce(self, call: Call, arr: np.ndarray, op: str, alg: str) -> Optional[Callable[[np.ndarray], Any]]:
        """Return ``f(x)``: :meth:`allreduce` of numpy arrays like ``arr`` in ``call`` (already checked once), or None.

        For the calls a loop repeats, where the fixed cost of planning a call
        shows (small buffers); ``f`` still runs in the collective lane and
        checks the call across ranks.
        """
        return None

    @abc.abstractmethod
    def _exchange_calls(self, call: Call, riding: Optional[Riding] = None) -> str:
        """Compare ``call`` across ranks; return "" if all agree, else the message for every rank.

        ``riding`` (only from :meth:`_riding_allreduce`) carries a payload to post with the call.
        """

    @abc.abstractmethod
    def _allreduce_native(self, acc: np.ndarray, op: str) -> np.ndarray:
        """Return the library's all-reduce of the flat buffer ``acc`` (may reuse ``acc``)."""

    def _transport(self):
        """Return the point-to-point transport the ring algorithms use."""
        raise ValueError(f"the {self.backend} backend has no point-to-point messages for algorithm='ring'")

    @abc.abstractmethod
    def _allgather_ints(self, value: int) -> List[int]:
        """Return every rank's ``value``."""

    @abc.abstractmethod
    def _alltoall_ints(self, values: List[int]) -> List[int]:
        """Send ``values[i]`` to rank i; return what each rank sent here."""

    @abc.abstractmethod
    def _allgatherv(self, raw: np.ndarray, counts: List[int]) -> np.ndarray:
        """Return the concatenation of every rank's bytes ``raw`` (rank i has ``counts[i]`` bytes)."""

    @abc.abstractmethod
    def _broadcast(self, raw: np.ndarray, root: int) -> None:
        """Overwrite ``raw`` (bytes) with root's in place."""

    @abc.abstractmethod
    def _reduce_scatter_native(self, acc: np.ndarray, counts: List[int], op: str) -> np.ndarray:
        """Return this rank's block (``counts[rank]`` elements) of the reduction of flat ``acc``."""

    @abc.abstractmethod
    def _alltoallv(self, raw: np.ndarray, send: List[int], recv: List[int]) -> np.ndarray:
        """Exchange byte blocks: ``send[i]`` bytes to rank i; return the ``recv`` blocks concatenated."""

    @abc.abstractmethod
    def _barrier(self) -> None:
        """Synchronize the ranks."""

    @abc.abstractmethod
    def _broadcast_object(self, obj: Any, root: int) -> Any:
        """Return root's object."""

    @abc.abstractmethod
    def _allgather_object(self, obj: Any) -> List[Any]:
        """Return every rank's object."""

    @abc.abstractmethod
    def _isend(self, arr: np.ndarray, dest: int, tag: int) -> Handle:
        """Start sending ``arr`` (owned by the call) with its dtype and shape; return a handle."""

    @abc.abstractmethod
    def _recv(self, source: int, tag: int) -> np.ndarray:
        """Receive an array sent by :meth:`_send`."""

    def _isend_bytes(self, raw: np.ndarray, dest: int, tag: int) -> Handle:
        """Start sending the flat uint8 array ``raw`` (owned by the call) alone; return a handle."""
        raise NotImplementedError(f"the {self.backend} backend has no header-less point-to-point messages")

    def _recv_bytes(self, source: int, tag: int) -> np.ndarray:
        """Receive a message sent by :meth:`_isend_bytes`, as a flat uint8 array of its length."""
        raise NotImplementedError(f"the {self.backend} backend has no header-less point-to-point messages")

    @abc.abstractmethod
    def _split(self, color: Optional[int], key: int) -> Optional["Communicator"]:
        """Return the sub-communicator for ``color`` (None for color None)."""

    def _free(self) -> None:
        """Release backend resources."""


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """Return a flat uint8 view of the C-contiguous array ``arr``."""
    return arr.reshape(-1).view(np.uint8)
