"""The data-moving collectives of a communicator: all-gather, broadcast, all-to-all and the object forms.

:class:`Exchanges` validates each call, describes it for the call check and
binds the work to the backend's byte primitives (``_allgatherv``,
``_broadcast``, ``_alltoallv``; the node's shared memory for large one-node
all-gathers).  Uneven first dimensions travel as one small all-gather of
row counts first.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional

import numpy as np

from ...collectives import registry
from ...tensors import dtype_name, to_numpy
from ..call.handle import Plan, same as _same
from ..call.repeated_calls import copy_body
from ..call.signature import Call

__all__ = ["Exchanges", "bytes_of"]


def bytes_of(arr: np.ndarray) -> np.ndarray:
    """Return a flat uint8 view of the C-contiguous array ``arr``."""
    return arr.reshape(-1).view(np.uint8)


class Exchanges:
    """The data-moving collectives of one communicator ``comm``."""

    def __init__(self, comm):
        self._c = comm

    def plan_allgather(self, x, algorithm="auto") -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            if arr.ndim == 0:
                raise ValueError("allgather needs a tensor with at least one dimension (it concatenates on dim 0)")
            shm = registry.lookup("allreduce", "shm")      # (the same shared memory gathers as well)
            valid = ("auto", "native") + (("shm",) if shm is not None and shm.runs_on(self._c.backend) else ())
            if algorithm not in valid:
                raise ValueError(f"unknown allgather algorithm {algorithm!r} for the {self._c.backend} backend; "
                                 f"expected one of {', '.join(valid)}")
            why = shm.refusal(self._c._reductions.where(), self._c.name) if algorithm == "shm" else ""
            if why:
                raise ValueError(why)
            call = Call("allgather", seq, dtype_name(arr.dtype), arr.shape, algorithm=algorithm, free_dim0=True)
            row_bytes = arr.itemsize * math.prod(arr.shape[1:])
            c = self._c
            if c._size == 1:
                body = copy_body(arr, arr.shape)
            else:
                body = c._backend.repeat_gather(call, algorithm != "native",
                                      lambda a, counts, parts: self._gathered(a, algorithm, counts, parts))
            if row_bytes:
                c._reductions.remember(x, arr, call, body, ("allgather", algorithm))
            if c._size > 1 and row_bytes:     # the byte counts (and small inputs) ride the call check
                carried = c._backend.gather_with_check(bytes_of(arr), algorithm != "native",
                                          lambda counts, parts: self._gathered(arr, algorithm, counts, parts))
                if carried is not None:
                    return call, carried, restore
            return call, lambda: self._do_allgather(arr, algorithm), restore
        return self._c._calls.build("allgather", build, algorithm=algorithm)

    def _do_allgather(self, arr: np.ndarray, algorithm: str = "auto") -> np.ndarray:
        row_bytes = arr.itemsize * math.prod(arr.shape[1:])
        rows = self._c._backend.allgather_ints(arr.shape[0])
        return self._gathered(arr, algorithm, [r * row_bytes for r in rows], rows=sum(rows))

    def _gathered(self, arr: np.ndarray, algorithm: str, counts: List[int],
                  parts: Optional[List[np.ndarray]] = None, rows: Optional[int] = None) -> np.ndarray:
        """Return the all-gather of ``arr`` given every rank's byte count (and bytes, ``parts``, if they came)."""
        if parts is not None:
            raw = np.concatenate(parts)
        else:
            raw = self._gather_bytes(bytes_of(arr), algorithm, counts)
        if rows is None:      # (rows of no bytes travel with their counts: _do_allgather)
            rows = sum(counts) // (arr.itemsize * math.prod(arr.shape[1:]))
        return raw.view(arr.dtype).reshape((rows,) + arr.shape[1:])

    def _gather_bytes(self, raw: np.ndarray, algorithm: str, counts: List[int]) -> np.ndarray:
        """Return every rank's bytes, concatenated: through shared memory ("shm", or "auto" where it is faster)
        or the library's Allgatherv (see :mod:`hpctrain.comm.call.measured_choice` for how "auto" decides)."""
        c, total = self._c, sum(counts)
        ways = {"shm": c._backend.allgather_shared, "native": c._backend.allgatherv}

        def by(a: np.ndarray, way: str) -> np.ndarray:
            return ways[way](a, counts)
        if algorithm == "native" or c._backend.no_shared_memory() or c.topology.num_nodes > 1:
            return by(raw, "native")
        if algorithm == "auto":
            measured = c._reductions.measured
            if measured is None:                   # a threshold was set
                if total < c._rt.config.shm_min_bytes:
                    return by(raw, "native")
            elif measured.applies(total):
                return measured.run("allgather", total, lambda way: by(raw, way), by, (raw.shape, raw.dtype))
            elif total <= measured.min_bytes:      # (above MEASURED_MAX_BYTES: shared memory)
                return by(raw, "native")
        return by(raw, "shm")

    def plan_broadcast(self, x, root) -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            self._c._calls.check_rank(root, "root")
            call = Call("broadcast", seq, dtype_name(arr.dtype), arr.shape, root=root)
            return call, lambda: self._do_broadcast(arr, root), restore
        return self._c._calls.build("broadcast", build, root=root)

    def _do_broadcast(self, arr: np.ndarray, root: int) -> np.ndarray:
        out = np.array(arr, copy=True, order="C")
        if self._c._size > 1 and out.size:
            self._c._backend.broadcast(bytes_of(out), root)
        return out

    def plan_alltoall(self, x, splits) -> Plan:
        def build(seq):
            arr, restore = to_numpy(x)
            if arr.ndim == 0:
                raise ValueError("alltoall needs a tensor with at least one dimension (it splits dim 0)")
            send = self._check_splits(arr.shape[0], splits)
            call = Call("alltoall", seq, dtype_name(arr.dtype), arr.shape, free_dim0=True)
            return call, lambda: self._do_alltoall(arr, send), restore
        return self._c._calls.build("alltoall", build)

    def _check_splits(self, rows: int, splits) -> List[int]:
        n = self._c._size
        if splits is None:
            if rows % n:
                raise ValueError(f"alltoall without splits needs dim 0 ({rows}) divisible by the {n} ranks")
            return [rows // n] * n
        splits = [int(s) for s in np.asarray(splits).reshape(-1)]
        if len(splits) != n or min(splits) < 0 or sum(splits) != rows:
            raise ValueError(f"alltoall splits {splits} must be {n} non-negative counts summing to dim 0 ({rows})")
        return splits

    def _do_alltoall(self, arr: np.ndarray, send: List[int]) -> np.ndarray:
        recv = self._c._backend.alltoall_ints(send)
        row_bytes = arr.itemsize * math.prod(arr.shape[1:])
        raw = self._c._backend.alltoallv(bytes_of(arr), [s * row_bytes for s in send], [s * row_bytes for s in recv])
        return raw.view(arr.dtype).reshape((sum(recv),) + arr.shape[1:])

    def plan_object(self, kind: str, obj: Any, root: Optional[int]) -> Plan:
        def build(seq):
            if root is not None:
                self._c._calls.check_rank(root, "root")
            if kind == "broadcast_object":
                return Call(kind, seq, root=root), lambda: self._c._backend.broadcast_object(obj, root), _same
            return Call(kind, seq), lambda: self._c._backend.allgather_object(obj), _same
        return self._c._calls.build(kind, build, root=root)

    def plan_split(self, color: Optional[int], key: int) -> Plan:
        def build(seq):
            if color is not None and (not isinstance(color, (int, np.integer)) or color < 0):
                raise ValueError(f"split color must be a non-negative int or None, got {color!r}")
            if not isinstance(key, (int, np.integer)):
                raise ValueError(f"split key must be an int, got {key!r}")
            return Call("split", seq), lambda: self._c._backend.split(color, int(key)), _same
        return self._c._calls.build("split", build)

    def plan_shared_empty(self, count: int, dtype: Any) -> Plan:
        def build(seq):
            dt = np.dtype(dtype)
            if not isinstance(count, (int, np.integer)) or count < 0:
                raise ValueError(f"count must be a non-negative int, got {count!r}")
            return (Call("shared_empty", seq, str(dt), (int(count),)), lambda: self._c._backend.shared_empty(int(count), dt),
                    _same)
        return self._c._calls.build("shared_empty", build)
