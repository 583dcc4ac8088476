"""The MPI backend's small one-node collectives that ride the call check through the mailbox.

Two forms of the same exchange (:mod:`hpctrain.comm.backends.mpi.mailbox`): ``*_with_check``
give a planned call's work as a :class:`~hpctrain.comm.call.handle.CarriedByCheck`, posted
by the call check itself; ``repeat_*`` give the bodies of repeated calls
(:mod:`hpctrain.comm.call.repeated_calls`), which post and check in one call of the
mailbox's C kernel.  Ranks on either form meet in the same exchange.  A part
of :class:`hpctrain.comm.backends.mpi.MPIBackend`, whose primitives of these names
are this object's (it reads the backend's ``_mailbox``, ``_size``, ``_rank``,
``_coll``, ``_MPI``, ``_ops``, ``_mismatch`` and ``_note_missing``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ....collectives.ops import accumulation_dtype, finish
from ....collectives.shm import shm_allreduce_small
from ....errors import CollectiveMismatchError
from ...call.handle import CarriedByCheck
from ...call.signature import Call, encoded

__all__ = ["MailboxCollectives"]


class MailboxCollectives:
    """Small all-reduces, reduce-scatters and all-gathers carried by the call check on one node, of ``backend``."""

    PRIMITIVES = ("allreduce_with_check", "reduce_scatter_with_check", "gather_with_check", "repeat_reduce_scatter",
                  "repeat_gather", "repeat_exchange")

    def __init__(self, backend):
        self._b = backend

    def _carry_dtype(self, arr: np.ndarray) -> Optional[np.dtype]:
        """Return the dtype in which ``arr`` is carried by the call check, or None (no mailbox, empty, or too big)."""
        mb, acc = self._b._mailbox, accumulation_dtype(arr.dtype)
        if mb is None or not arr.size or arr.size * acc.itemsize > mb.capacity:
            return None
        return acc

    def allreduce_with_check(self, arr: np.ndarray, op: str, alg: str, inplace: bool) -> Optional[CarriedByCheck]:
        mb, acc = self._b._mailbox, self._carry_dtype(arr)
        if acc is None:
            return None

        def reduce():
            out = arr if inplace and acc == arr.dtype else np.empty(arr.shape, dtype=acc)
            shm_allreduce_small(mb.payloads(arr.shape, acc), out, op)
            return finish(out, op, self._b._size, arr.dtype)
        return CarriedByCheck(arr, acc, reduce)

    def reduce_scatter_with_check(self, arr: np.ndarray, bounds, op: str) -> Optional[CarriedByCheck]:
        acc = self._carry_dtype(arr)
        if acc is None:
            return None
        own = self._own_block(arr, bounds, acc, op)
        return CarriedByCheck(arr, acc, own)

    def _own_block(self, arr: np.ndarray, bounds, acc: np.dtype, op: str):
        """Return ``f()``: this rank's block of the reduction of the payloads of the last exchange (flat)."""
        mb, n, size, dtype = self._b._mailbox, self._b._size, arr.size, arr.dtype
        lo, hi = int(bounds[self._b._rank]), int(bounds[self._b._rank + 1])

        def own():
            out = np.empty(hi - lo, dtype=acc)
            shm_allreduce_small([p[lo:hi] for p in mb.payloads(size, acc)], out, op)
            return finish(out, op, n, dtype)
        return own

    def gather_with_check(self, raw: np.ndarray, post: bool, then) -> Optional[CarriedByCheck]:
        mb = self._b._mailbox
        if mb is None:
            return None
        fits = post and raw.nbytes <= mb.capacity

        def gather():
            sizes = mb.sizes()
            return then(sizes, mb.raw_payloads(sizes) if post and max(sizes) <= mb.capacity else None)
        return CarriedByCheck(raw if fits else None, np.dtype(np.uint8) if fits else None, gather, raw.nbytes)

    def repeat_reduce_scatter(self, call: Call, arr: np.ndarray, bounds, op: str, alg: str):
        """The body of a repeated reduce-scatter (:mod:`hpctrain.comm.call.repeated_calls`): the input is carried by the call check
        (:meth:`reduce_scatter_with_check` without the planning); None where it cannot."""
        mb, acc = self._b._mailbox, self._carry_dtype(arr)
        if acc is None or alg not in ("shm", "hierarchical"):
            return None
        key_hash, desc = encoded(call)
        own, note, raw = self._own_block(arr, bounds, acc, op), self._b._note_missing, acc == arr.dtype

        def body(a: np.ndarray, seq: int) -> np.ndarray:
            if not (mb.post(key_hash, desc, a, note) if raw else mb.exchange(key_hash, desc, a, acc, note)):
                raise CollectiveMismatchError(self._b._mismatch(seq), every_rank=True)
            return own()
        return body

    def repeat_gather(self, call: Call, post: bool, then):
        """The body of a repeated all-gather: every rank's byte count, and where ``post`` and all fit their bytes,
        ride the call check (:meth:`gather_with_check`); returns ``then(a, sizes, None)`` when the bytes did not
        travel, else the gathered array.  None without a mailbox."""
        mb = self._b._mailbox
        if mb is None:
            return None
        key_hash, desc = encoded(call)
        note, capacity, u8 = self._b._note_missing, mb.capacity, np.dtype(np.uint8)
        as_bytes = call.dtype == "bfloat16"            # (no buffer protocol for ml_dtypes' dtype)

        def body(a: np.ndarray, seq: int):
            fits = post and a.nbytes <= capacity
            if not mb.post(key_hash, desc, (a.reshape(-1).view(u8) if as_bytes else a) if fits else None, note,
                           a.nbytes):
                raise CollectiveMismatchError(self._b._mismatch(seq), every_rank=True)
            joined = mb.gathered() if post else None
            if joined is None:
                return then(a, mb.sizes(), None)
            return joined.view(a.dtype).reshape((-1,) + a.shape[1:])
        return body

    def repeat_exchange(self, call: Call, arr: np.ndarray, op: str, alg: str):
        """The exchange of a repeated all-reduce (:mod:`hpctrain.comm.call.repeated_calls`): the payload is carried by the call check.

        Returns ``exchange(x, out, seq)``, or None where it does not apply (no
        mailbox, too big, not a shared-memory algorithm).  Sums of
        float32/float64/int32/int64 exchange and reduce in one call of the
        mailbox's C kernel (:meth:`Mailbox.sum_small`); others, or without the
        kernel, in the Python exchange.  ``out`` may be ``x`` (each rank's input
        is in its slot before any output is written).  Cost: one mailbox exchange
        and ``n`` reads of the payload.
        """
        mb, acc = self._b._mailbox, self._carry_dtype(arr)
        if mb is not None and alg == "native":
            return self._repeat_native(call, op, arr.dtype)
        if acc is None or alg not in ("shm", "hierarchical"):
            return None
        key_hash, desc = encoded(call)
        shape, note = arr.shape, self._b._note_missing
        code = mb.sum_code(acc, op) if acc == arr.dtype else None

        def exchange(x: np.ndarray, out: np.ndarray, seq: int) -> None:
            if code is not None:
                if not mb.sum_small(key_hash, desc, x, out, code, note):
                    raise CollectiveMismatchError(self._b._mismatch(seq), every_rank=True)
                return
            if not mb.exchange(key_hash, desc, x, acc, note):
                raise CollectiveMismatchError(self._b._mismatch(seq), every_rank=True)
            shm_allreduce_small(mb.payloads(shape, acc), out, op)
        return exchange

    def _repeat_native(self, call: Call, op: str, dtype: np.dtype):
        """The exchange of a repeated "native" all-reduce on one node: the call check through the mailbox (in C,
        no payload), then the library's in-place all-reduce.  Cost: one mailbox exchange and MPI_Allreduce."""
        mb, key_hash, desc = self._b._mailbox, *encoded(call)
        coll, in_place, note = self._b._coll, self._b._MPI.IN_PLACE, self._b._note_missing
        words, mpi_op = self._b.library_args(np.empty(0, dtype), op)   # (16-bit floats: as 16-bit words)
        view = words.dtype if words.dtype != dtype else None

        def exchange(x: np.ndarray, out: np.ndarray, seq: int) -> None:
            if not mb.post(key_hash, desc, None, note):
                raise CollectiveMismatchError(self._b._mismatch(seq), every_rank=True)
            if out is not x:
                np.copyto(out, x)
            coll.Allreduce(in_place, out if view is None else out.view(view), op=mpi_op)
        return exchange
