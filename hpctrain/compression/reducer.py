"""Reduce a step's gradients with a compressor: one fused collective per kind of payload.

``CompressedReducer.start(entries, op)`` takes ``(name, array)`` pairs and
returns a :class:`Pending`; ``wait()`` leaves in every array the reduction
over ranks of what the compressor sent (the mean for ``op="avg"``).  Per call:

* tensors the :class:`~hpctrain.compression.base.Policy` keeps dense (casting
  compressors ignore it: fp16 and bf16 take every float tensor), and every
  tensor when the compressor is ``none``: one grouped all-reduce;
* all-reduce compressors (fp16, bf16, random-k): their payloads summed by one
  grouped all-reduce, then ``x_hat = decompress(sum) / N``;
* all-gather compressors: every payload of the call packed into one byte
  buffer (a small header of dtypes and lengths, then the arrays) and
  all-gathered once; each rank decompresses every rank's payload, sums in
  rank order and ``finish`` makes the result (so all ranks get the same bits);
* custom compressors (PowerSGD) run their own collectives.

Compression happens in ``start`` on the caller's thread (PyTorch: while
backward still runs) and the collectives are asynchronous; decompression
happens in ``wait``.  Gradients of any float dtype are compressed in float32
and written back in their own dtype.

``stats()``: bytes of payload this rank sent and received, the float32 bytes
the same gradients would have taken, and time spent compressing and
decompressing, summed over the steps counted with ``count_step()``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import settings
from ..waiting import wait_until
from .base import Compressor, Policy


def _on_timeline(comm, name: str, started: float, **args) -> None:
    """Put a span from ``started`` until now on the communicator's timeline, when it records."""
    tl = comm.timeline
    if tl.on:
        tl.add(name, "compression", started, time.perf_counter(), args)

__all__ = ["CompressedReducer", "Pending", "pack_payloads", "unpack_payloads"]

_WIRE_DTYPES = [np.dtype(t) for t in (np.float32, np.float16, np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                      np.int64)]
_CODE = {d: i for i, d in enumerate(_WIRE_DTYPES)}


def pack_payloads(payloads: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """One uint8 buffer holding every array of ``payloads``: ``[total, count, (dtype, nbytes)*, data]``.

    The header is int64; each array's bytes are padded to 8, so the buffer can
    be parsed without knowing what the sender compressed.
    """
    arrays = [np.ascontiguousarray(a) for p in payloads for a in p]
    for a in arrays:
        if a.dtype not in _CODE:
            raise TypeError(f"payload dtype {a.dtype} cannot be sent; use one of {[str(d) for d in _WIRE_DTYPES]}")
    header = [0, len(arrays)] + [v for a in arrays for v in (_CODE[a.dtype], a.nbytes)]
    head = len(header) * 8
    total = head + sum(-(-a.nbytes // 8) * 8 for a in arrays)
    header[0] = total
    buf = np.zeros(total, dtype=np.uint8)
    buf[:head] = np.array(header, dtype=np.int64).view(np.uint8)
    off = head
    for a in arrays:
        buf[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        off += -(-a.nbytes // 8) * 8
    return buf


def unpack_payloads(buf: np.ndarray, counts: Sequence[int]) -> Tuple[List[List[np.ndarray]], int]:
    """Split the buffer at the start of ``buf`` into payloads of ``counts`` arrays; returns (payloads, bytes used)."""
    total, n = (int(v) for v in buf[:16].view(np.int64))
    if n != sum(counts):
        raise ValueError(f"a peer sent {n} payload arrays where {sum(counts)} were expected")
    meta = buf[16:16 + 16 * n].view(np.int64).reshape(n, 2)
    off = 16 + 16 * n
    arrays = []
    for code, nbytes in meta:
        arrays.append(buf[off:off + nbytes].view(_WIRE_DTYPES[int(code)]))
        off += -(-int(nbytes) // 8) * 8
    out, i = [], 0
    for c in counts:
        out.append(arrays[i:i + c])
        i += c
    return out, total


class Pending:
    """A compressed reduction in flight, a :class:`~hpctrain.comm.call.handle.Waitable`.

    ``in_flight``: the handles of the collectives it started; ``test()`` is
    true once all of them are done; ``wait(timeout=None)`` waits for them
    (:class:`TimeoutError` when ``timeout`` seconds pass first; wait again),
    then runs ``finish`` once (decompression, and for PowerSGD its second,
    synchronous all-reduce) and returns ``result``.
    """

    def __init__(self, finish: Callable[[], None], result: Any, in_flight: Sequence[Any] = ()):
        self._finish, self.result = finish, result
        self._in_flight = [h for h in in_flight if h is not None]

    def test(self) -> bool:
        return self._finish is None or all(h.test() for h in self._in_flight)

    def wait(self, timeout: Optional[float] = None) -> Any:
        if self._finish is not None:
            wait_until(self.test, timeout, "the compressed reduction")
            finish, self._finish = self._finish, None
            finish()
        return self.result


class CompressedReducer:
    """Average named gradient buffers over ``comm`` through ``compressor``.

    Args:
        compressor: a :class:`~hpctrain.compression.base.Compressor` (its
            state lives in it; one compressor per optimizer).
        comm: the communicator.
        policy: which tensors to compress (default :class:`Policy()`).
    """

    def __init__(self, compressor: Compressor, comm, policy: Optional[Policy] = None):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compression must be a hpctrain.compression compressor, e.g. "
                            f"hpctrain.compression.get('fp16'), got {compressor!r}")
        if compressor.carries_state:
            settings.refuse_under_elastic(
                f"compression {compressor!r}", "it keeps state between steps, and a commit holds none of it",
                "use compression 'fp16', 'bf16' or none under --elastic, or launch without --elastic and resume "
                "from its checkpoints (the compressor's state saved as Sharded(compressor))")
        self.compressor, self.comm = compressor, comm
        self.policy = policy if policy is not None else Policy()
        self._totals: Dict[str, float] = dict.fromkeys(
            ("steps", "tensors", "compressed_tensors", "sent_bytes", "received_bytes", "dense_bytes",
             "compress_s", "decompress_s"), 0)

    def count_step(self) -> None:
        """Count one optimizer step (``stats()`` reports per-step averages over them)."""
        self._totals["steps"] += 1

    def stats(self) -> Dict[str, float]:
        """Totals since creation, and per-step averages (``*_per_step``) and the ratio to float32."""
        t = dict(self._totals)
        steps = max(1, t["steps"])
        for k in ("sent_bytes", "received_bytes", "dense_bytes", "compress_s", "decompress_s"):
            t[f"{k}_per_step"] = t[k] / steps
        t["ratio_to_fp32"] = t["sent_bytes"] / t["dense_bytes"] if t["dense_bytes"] else 1.0
        t["compressor"] = repr(self.compressor)
        return t

    def reduce(self, entries: Sequence[Tuple[str, np.ndarray]], op: str = "avg") -> List[np.ndarray]:
        """:meth:`start` and wait: the arrays now hold the reduced values."""
        return self.start(entries, op).wait()

    def start(self, entries: Sequence[Tuple[str, np.ndarray]], op: str = "avg") -> Pending:
        """Compress ``entries`` and start their collectives; every array is overwritten by ``wait()``."""
        if op not in ("avg", "sum"):
            raise ValueError(f"compressed reduction takes op 'avg' or 'sum', got {op!r}")
        comp = self.compressor
        names = [n for n, _ in entries]
        if len(set(names)) != len(names):
            raise ValueError("tensor names given to a compressed reduction must be unique")
        arrays = [a for _, a in entries]
        for n, a in entries:
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or not a.flags.writeable:
                raise TypeError(f"tensor {n!r}: a compressed reduction writes its result in place and needs a "
                                f"writable C-contiguous numpy array, got {type(a).__name__}")
        packed = [i for i, (n, a) in enumerate(entries)
                  if comp.name != "none" and a.dtype.kind == "f"
                  and (comp.policy_exempt or self.policy.compress(n, a.size))]
        chosen = set(packed)
        dense = [i for i in range(len(entries)) if i not in chosen]
        t = self._totals
        t["tensors"] += len(entries)
        t["compressed_tensors"] += len(packed)
        t["dense_bytes"] += sum(4 * a.size if a.dtype.kind == "f" else a.nbytes for a in arrays)
        dense_bytes = sum(arrays[i].nbytes for i in dense)
        t["sent_bytes"] += dense_bytes
        t["received_bytes"] += dense_bytes
        finishers: List[Callable[[], None]] = []
        in_flight: List[Any] = []
        if dense and self.comm.size > 1:
            handle = self.comm.grouped_allreduce_async([arrays[i] for i in dense], op=op, inplace=True)
            finishers.append(handle.wait)
            in_flight.append(handle)
        if packed:
            started = time.perf_counter()
            items = [(entries[i][0], arrays[i]) for i in packed]
            if comp.communication == "custom":
                handle, finish_packed = comp.exchange(self.comm, items, op, self._totals)
            else:
                handle, finish_packed = self._start_standard(items, op)
            finishers.append(finish_packed)
            in_flight.append(handle)
            t["compress_s"] += time.perf_counter() - started
            _on_timeline(self.comm, "compress", started, compressor=comp.name, tensors=len(packed))

        def finish():
            for f in finishers:
                f()

        return Pending(finish, arrays, in_flight)

    def _start_standard(self, items: List[Tuple[str, np.ndarray]], op: str) -> Tuple[Any, Callable[[], None]]:
        """Compress ``items`` and start their collective: (its handle, or None at one rank; the call that
        finishes the step)."""
        comp, comm, t = self.compressor, self.comm, self._totals
        payloads, ctxs = [], []
        for name, a in items:
            slot = comp.slot(name, a.shape, comm.rank)
            x = np.asarray(a, dtype=np.float32).reshape(-1)
            c = comp.compensate(x, slot)
            payload, ctx = comp.compress(c, slot)
            if comp.error_feedback:
                comp.remember(c, comp.decompress(payload, ctx, c.size), slot)
            slot.step += 1
            payloads.append(payload)
            ctxs.append(ctx)
        sent = sum(comp.payload_bytes(p) for p in payloads)
        t["sent_bytes"] += sent
        if comp.communication == "allreduce":
            flat = [np.ascontiguousarray(p) for payload in payloads for p in payload]
            handle = comm.grouped_allreduce_async(flat, op="sum") if comm.size > 1 else None
            t["received_bytes"] += sent

            def finish_allreduce():
                summed = handle.wait() if handle is not None else flat
                started, k = time.perf_counter(), 0
                for (name, a), payload, ctx in zip(items, payloads, ctxs):
                    total = comp.decompress(summed[k:k + len(payload)], ctx, a.size)
                    k += len(payload)
                    a.reshape(-1)[...] = comp.finish(total, comm.size, op)
                t["decompress_s"] += time.perf_counter() - started
                _on_timeline(comm, "decompress", started, compressor=comp.name, tensors=len(items))
            return handle, finish_allreduce

        if comp.communication != "allgather":
            raise ValueError(f"compressor {comp.name!r} declares unknown communication {comp.communication!r}")
        blob = pack_payloads(payloads)
        handle = comm.allgather_async(blob) if comm.size > 1 else None

        def finish_allgather():
            gathered = handle.wait() if handle is not None else blob
            started = time.perf_counter()
            counts = [len(p) for p in payloads]
            per_rank, off = [], 0
            for _ in range(comm.size):
                got, used = unpack_payloads(gathered[off:], counts)
                per_rank.append(got)
                off += used
            t["received_bytes"] += sum(comp.payload_bytes(p) for r, got in enumerate(per_rank)
                                       if r != comm.rank for p in got)
            for j, (name, a) in enumerate(items):
                total = None
                for r in range(comm.size):
                    part = comp.decompress(per_rank[r][j], ctxs[j] if r == comm.rank else None, a.size)
                    total = part.astype(np.float32, copy=True) if total is None else np.add(total, part, out=total)
                a.reshape(-1)[...] = comp.finish(total, comm.size, op)
            t["decompress_s"] += time.perf_counter() - started
            _on_timeline(comm, "decompress", started, compressor=comp.name, tensors=len(items))
        return handle, finish_allgather
