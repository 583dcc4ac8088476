"""The reductions of a communicator: all-reduce, grouped all-reduce and reduce-scatter, planned and run.

:class:`Reductions` turns a call into a plan (see :mod:`hpctrain.comm.base`):
it converts the input, checks the op, chooses the algorithm through
:mod:`hpctrain.collectives.registry` and binds the work: a registered
algorithm's ``run`` on the flat accumulation buffer, or the backend's
shared-memory path for the algorithms that run on its windows.  It remembers
the plans of calls a training loop repeats (same dtype, shape, op and
algorithm) and forgets them when the registry changes.  Cost of a plan: one
conversion and one registry choice; a repeated numpy call skips both.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

from ...collectives import registry
from ...collectives.fusion import FusionBuffers
from ...collectives.ops import accumulation_dtype, check_op, finish, segment_bounds, to_accumulator
from ...collectives.results import ResultBuffers
from ...collectives.flat import Flat
from ...tensors import dtype_name, framework_of, to_numpy
from ..call.handle import Plan, same as _same
from ..call.repeated_calls import allreduce_body, copy_body, repeat_key, make_repeat
from ..call.algorithm_links import Links
from .grouped import GroupedReductions
from .inplace import copy_back_into as _copy_back_into
from ..call.measured_choice import MeasuredChoice
from ..call.signature import Call

__all__ = ["Reductions"]


@functools.lru_cache(maxsize=256)
def _blocks(shape: tuple, n: int):
    """Return (row offsets of the ``n`` blocks of dim 0, elements per row) for a reduce-scatter of ``shape``."""
    rows = tuple(int(b) for b in segment_bounds(shape[0], n))
    return rows, math.prod(shape[1:])


class Reductions(GroupedReductions):
    """The reductions of one communicator ``comm`` and what they remember between calls."""

    def __init__(self, comm):
        self._c = comm
        self.seen: dict = {}               # (dtype, shape, op, algorithm) -> (checked call, algorithm)
        self.repeats: dict = {}               # repeat_key -> the call's repeat path (see repeated_calls.py)
        self.repeat_types: set = set()       # the types of inputs in ``repeats``
        self.seen_grouped: dict = {}       # (op, algorithm, dtypes and shapes) -> grouped_allreduce's plan
        self.algorithms: dict = {}         # name -> registry.Algorithm, as chosen here before
        self.chosen: dict = {}             # (algorithm asked for, bytes) -> registry.Algorithm
        self.fusion = FusionBuffers()
        self.results = ResultBuffers()     # memory of large results, reused once the caller drops them
        self.links = Links(comm)
        cfg = comm._rt.config
        # (HPCTRAIN_SHM_MIN_BYTES=0, the default: mid-size one-node calls measure hpctrain's way against the library's)
        self.measured = (MeasuredChoice(lambda times: comm._backend.allreduce_native(times, "max"), cfg.shm_small_bytes)
                         if cfg.shm_min_bytes == 0 else None)
        registry.on_change(self.forget)

    def where(self) -> registry.Where:
        """What choosing an algorithm here depends on (see :class:`hpctrain.collectives.registry.Where`)."""
        c = self._c
        return registry.Where(c.backend, c.size, c.topology.num_nodes, c._backend.no_shared_memory(), c.config,
                              c._rt.policy.reforms)

    def choose(self, algorithm: str, nbytes: int) -> str:
        """Return the name of the all-reduce algorithm to run (``auto``: the registry's cheapest here).

        A choice depends only on the name, the size and this communicator, so
        it is remembered (until the registry changes).
        """
        chosen = self.chosen.get((algorithm, nbytes))
        if chosen is None:
            chosen = self._choose(algorithm, nbytes)
            if len(self.chosen) > 256:
                self.chosen.clear()
            self.chosen[(algorithm, nbytes)] = chosen
        self.algorithms[chosen.name] = chosen
        return chosen.name

    def _choose(self, algorithm: str, nbytes: int) -> registry.Algorithm:
        where = self.where()
        if algorithm == "auto":
            chosen = registry.choose("allreduce", where, nbytes)
        else:
            chosen = registry.lookup("allreduce", algorithm)
            if chosen is None or not chosen.runs_on(self._c.backend):
                raise ValueError(f"unknown algorithm {algorithm!r} for the {self._c.backend} backend; "
                                 f"expected one of {', '.join(self._c.allreduce_algorithms())}")
            why = chosen.refusal(where, self._c.name)
            if why:
                raise ValueError(why)
        return chosen

    def forget(self) -> None:
        """Drop the remembered choices and plans of repeated calls (the registered algorithms changed)."""
        self.chosen.clear()
        self.seen.clear()
        self.repeats.clear()
        self.seen_grouped.clear()

    def shared_alg(self, alg: str) -> bool:
        """Return True if ``alg`` (chosen here before) runs on the backend's shared memory."""
        return self._algorithm(alg).shared_memory

    def plan_allreduce(self, x, op, algorithm, inplace=False) -> Plan:
        # A training loop repeats a few calls: a C-contiguous numpy input of a dtype, shape, op and
        # algorithm seen before skips the checks it passed then (they depend on nothing else).
        seen = (type(x) is np.ndarray and not inplace and x.flags.c_contiguous
                and self.seen.get((x.dtype, x.shape, op, algorithm)))
        if seen:
            call, alg = seen
            return call.at(self._c._calls.next_seq()), self._allreduce_work(x, op, algorithm, alg, False), _same

        def build(seq):
            arr, restore = to_numpy(x)
            check_op(op, arr.dtype)
            alg = self.choose(algorithm, arr.nbytes)
            shared = (inplace and self.shared_alg(alg) and self._c._size > 1 and arr.size > 0
                      and accumulation_dtype(arr.dtype) == arr.dtype and self._c._backend.shared_buffer_of(arr) is not None)
            call = Call("allreduce", seq, dtype_name(arr.dtype), arr.shape, op=op, algorithm=alg,
                        layout="shared buffer" if shared else None)
            if inplace:
                restore = _copy_back_into(x, arr, restore)
            if shared:    # (a small one is carried along with the call check: one exchange, no fences)
                carried = self._c._backend.allreduce_with_check(arr, op, alg, True)
                return call, carried or (lambda: self._allreduce_shared_buffer(arr, op)), restore
            if type(x) is np.ndarray and not inplace and x.flags.c_contiguous:
                if len(self.seen) > 256:
                    self.seen.clear()
                self.seen[(x.dtype, x.shape, op, algorithm)] = (call, alg)
            self._remember_repeat(x, arr, call, op, algorithm, alg, inplace)
            return call, self._allreduce_work(arr, op, algorithm, alg, inplace), restore
        return self._c._calls.build("allreduce", build, op=op, algorithm=algorithm)

    def _remember_repeat(self, x, arr: np.ndarray, call: Call, op: str, algorithm: str, alg: str,
                       inplace: bool) -> None:
        """Leave the repeat path of all-reduces like this one (:mod:`hpctrain.comm.call.repeated_calls`) where one applies."""
        c = self._c
        exchange = c._backend.repeat_exchange(call, arr, op, alg) if c._size > 1 else None
        body = allreduce_body(c, arr, op, inplace, exchange)
        self.remember(x, arr, call, body, ("allreduce", op, algorithm, inplace), inplace)

    def remember(self, x, arr: np.ndarray, call: Call, body, key: tuple, inplace: bool = False) -> None:
        """Remember ``body`` as the repeat path of calls like ``call`` on inputs like ``x`` (see repeated_calls.py)."""
        kind = framework_of(x)
        if body is None or (kind == "numpy" and type(x) is not np.ndarray):
            return
        repeat = make_repeat(self._c, call, kind, arr, body, inplace)
        if repeat is not None:
            if len(self.repeats) > 256:
                self.repeats.clear()
                self.seen.clear()        # (a call found there is not planned again, so it would stay off ``repeats``)
            self.repeats[repeat_key(x, *key)] = repeat
            self.repeat_types.add(type(x))

    def _allreduce_work(self, arr: np.ndarray, op: str, asked: str, alg: str, inplace: bool):
        shared = self.shared_alg(alg) and self._c._size > 1
        carried = self._c._backend.allreduce_with_check(arr, op, alg, inplace) if shared else None
        if carried is not None:
            return carried
        measured = self.measuring(asked, alg, arr.nbytes)
        return lambda: self._do_allreduce(arr, op, alg, inplace, measured)

    def measuring(self, asked: str, alg: str, nbytes: int) -> bool:
        """Return True if a call that asked for ``asked`` and runs ``alg`` at ``nbytes`` runs the measured way
        ("auto" chose "shm" on a communicator that measures, above HPCTRAIN_SHM_SMALL_BYTES)."""
        return (asked == "auto" and alg == "shm" and self.measured is not None and self._c._size > 1
                and self.measured.applies(nbytes))

    def _do_allreduce(self, arr: np.ndarray, op: str, alg: str, inplace: bool = False,
                      measured: bool = False) -> np.ndarray:
        if measured:
            def by(a, way):
                return self._allreduce_by(a, op, way, inplace)
            return self.measured.run("allreduce", arr.nbytes, lambda way: by(arr, way), by, (arr.shape, arr.dtype))
        return self._allreduce_by(arr, op, alg, inplace)

    def _allreduce_by(self, arr: np.ndarray, op: str, alg: str, inplace: bool) -> np.ndarray:
        same = inplace and accumulation_dtype(arr.dtype) == arr.dtype
        if self.shared_alg(alg) and self._c._size > 1 and arr.size:
            # in place, the result goes straight into ``arr``: its parts are read before they are written
            acc = self._shared_reduction(arr, op, alg, into=arr.reshape(-1) if same else None)
            return finish(acc, op, 1, arr.dtype).reshape(arr.shape)   # (divided already)
        acc = arr.reshape(-1) if same else self._accumulator(arr)
        if self._c._size > 1 and acc.size:
            acc = self._algorithm(alg).run(self.links, acc, op)
        return finish(acc, op, self._c._size, arr.dtype).reshape(arr.shape)

    def _algorithm(self, alg: str) -> registry.Algorithm:
        """Return the algorithm ``alg`` (chosen here before, or "native", which a measured choice may run)."""
        found = self.algorithms.get(alg)
        if found is None:
            found = self.algorithms[alg] = registry.lookup("allreduce", alg)
        return found

    def _allreduce_shared_buffer(self, arr: np.ndarray, op: str) -> np.ndarray:
        """In-place all-reduce of a buffer from :meth:`shared_empty`: no copies in or out (see its docstring)."""
        self._c._backend.reduce_shared_buffer(self._c._backend.shared_buffer_of(arr), op, self._divisor(op))
        return arr

    def _accumulator(self, arr: np.ndarray) -> np.ndarray:
        """Return a copy of ``arr``, flat, in its accumulation dtype, in memory from the result pool."""
        acc = self.results.empty(arr.size, accumulation_dtype(arr.dtype))
        np.copyto(acc, arr.reshape(-1), casting="unsafe")
        return acc

    def _shared_reduction(self, arr: np.ndarray, op: str, alg: str,
                          into: Optional[np.ndarray] = None) -> np.ndarray:
        """Return the "shm"/"hierarchical" reduction of ``arr``: a flat accumulation-dtype array (``into`` if given)."""
        acc = self.results.empty(arr.size, accumulation_dtype(arr.dtype)) if into is None else into
        self._c._backend.allreduce_shared(Flat([arr]), Flat([acc]), op, alg, self._divisor(op))
        return acc

    def _divisor(self, op: str) -> int:
        """What the shared-memory algorithms divide their results by: the world size for ``avg``, else 1."""
        return self._c._size if op == "avg" else 1

    def plan_reduce_scatter(self, x, op, algorithm) -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            if arr.ndim == 0:
                raise ValueError("reduce_scatter needs a tensor with at least one dimension (it splits dim 0)")
            check_op(op, arr.dtype)
            alg = self.choose(algorithm, arr.nbytes)
            call = Call("reduce_scatter", seq, dtype_name(arr.dtype), arr.shape, op=op, algorithm=alg)
            c = self._c
            rows, row = _blocks(arr.shape, c._size)
            shape = (rows[c._rank + 1] - rows[c._rank],) + arr.shape[1:]
            bounds = [b * row for b in rows]
            if c._size == 1:
                body = copy_body(arr, shape)
            else:
                body = c._backend.repeat_reduce_scatter(call, arr, bounds, op, alg) if self.shared_alg(alg) else None
                body = body and (lambda a, seq, own=body: own(a, seq).reshape(shape))
            self.remember(x, arr, call, body, ("reduce_scatter", op, algorithm))
            if c._size > 1 and self.shared_alg(alg):    # a small one is carried by the call check: one exchange
                carried = c._backend.reduce_scatter_with_check(arr, bounds, op)
                if carried is not None:
                    return call, carried, lambda out: restore(out.reshape(shape))
            measured = self.measuring(algorithm, alg, arr.nbytes) and arr.size > 0
            return call, lambda: self._do_reduce_scatter(arr, op, alg, measured), restore
        return self._c._calls.build("reduce_scatter", build, op=op, algorithm=algorithm)

    def _do_reduce_scatter(self, arr: np.ndarray, op: str, alg: str, measured: bool = False) -> np.ndarray:
        if measured:
            def by(a, way):
                return self._reduce_scatter_by(a, op, way)
            return self.measured.run("reduce_scatter", arr.nbytes, lambda way: by(arr, way), by,
                                     (arr.shape, arr.dtype))
        return self._reduce_scatter_by(arr, op, alg)

    def _reduce_scatter_by(self, arr: np.ndarray, op: str, alg: str) -> np.ndarray:
        n, r = self._c._size, self._c._rank
        rows, row = _blocks(arr.shape, n)
        bounds = np.asarray(rows, dtype=np.int64) * row
        if self.shared_alg(alg) and n > 1 and arr.size:
            if alg == "shm":
                acc = self._c._backend.reduce_scatter_shared(arr.reshape(-1), bounds, accumulation_dtype(arr.dtype), op)
                out = finish(acc, op, n, arr.dtype)
            else:   # hierarchical: the full reduction (divided already), then the own block
                out = finish(self._shared_reduction(arr, op, alg)[bounds[r]:bounds[r + 1]], op, 1, arr.dtype)
            return out.reshape((int(rows[r + 1] - rows[r]),) + arr.shape[1:])
        acc = to_accumulator(arr)
        if n > 1 and acc.size:
            algorithm = self._algorithm(alg)
            if algorithm.reduce_scatter is not None:
                acc = algorithm.reduce_scatter(self.links, acc, bounds, op)
            else:     # the full all-reduce, then the own block
                acc = algorithm.run(self.links, acc, op)[bounds[r]:bounds[r + 1]]
        else:
            acc = acc[bounds[r]:bounds[r + 1]]
        out = finish(acc, op, n, arr.dtype)
        return out.reshape((int(rows[r + 1] - rows[r]),) + arr.shape[1:])
