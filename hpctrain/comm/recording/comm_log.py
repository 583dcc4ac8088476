"""A log of the collectives a rank ran: count, bytes, latency and bandwidth per collective and size bucket.

As DeepSpeed's comms logger does, each entry is one collective kind and one
size bucket (message sizes rounded up to a power of two): how many calls,
their total bytes, mean latency, and

* ``algbw = bytes / latency`` (GB/s, 1e9 bytes), what the caller sees;
* ``busbw = algbw * factor``, the bandwidth each rank's link carries, with
  nccl-tests' factors for ``n`` ranks: all-reduce ``2 (n-1)/n``; all-gather,
  reduce-scatter and all-to-all ``(n-1)/n``; broadcast 1; others none.

Bytes are the call's input, except all-gather: its gathered output (``n``
times an even input).  Latency runs from the moment the collective lane
starts the call (its argument check included) until its result is ready;
time queued behind earlier asynchronous calls does not count.  On with
``HPCTRAIN_COMM_LOG=1`` (rank 0 prints the table at ``hpctrain.shutdown()``)
or at run time with ``comm.comm_log.start()``; ``comm.comm_log.table()``
returns it on demand.  Cost while on: two clock reads and a dictionary
update per call (the small all-reduces then take the general path instead of
the repeat one); while off: one attribute test per call.

While on, it also keeps running totals (:meth:`CommLog.totals`): calls, bytes,
seconds in collectives, and seconds the calling thread was blocked on them (a
synchronous call, or ``Handle.wait()`` on a call that had not finished): the
exposed, not overlapped, communication that :mod:`hpctrain.observe` reports
per step.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

from .recorder import Recorder

__all__ = ["CommLog", "bus_factor", "call_bytes"]


def bus_factor(kind: str, n: int) -> Optional[float]:
    """Return nccl-tests' bus-bandwidth factor of collective ``kind`` on ``n`` ranks (None: not defined)."""
    if kind in ("allreduce", "grouped_allreduce"):
        return 2 * (n - 1) / n
    if kind in ("allgather", "reduce_scatter", "alltoall"):
        return (n - 1) / n
    if kind == "broadcast":
        return 1.0
    return None


def _itemsize(name: str) -> int:
    try:
        return np.dtype(name).itemsize
    except TypeError:                      # bfloat16 and other names numpy lacks
        return 2 if name.endswith("16") else 4


def call_bytes(call, n: int) -> int:
    """Return the bytes a collective :class:`~hpctrain.comm.call.signature.Call` moves (see the module docstring).

    A grouped call of several dtypes counts every element at the widest.
    """
    if not call.dtype:
        return 0
    itemsize = max(_itemsize(d) for d in call.dtype.split("+"))
    count = int(np.prod(call.shape, dtype=np.int64))
    return count * itemsize * (n if call.kind == "allgather" else 1)


def _bucket(nbytes: int) -> int:
    """The size bucket of ``nbytes``: the next power of two (0 stays 0)."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


class CommLog(Recorder):
    """The per-rank log (see the module docstring); thread-safe."""

    def __init__(self, on: bool = False):
        super().__init__(on)
        self._rows: Dict[Tuple[str, int, int], List[float]] = {}
        self._totals = [0, 0, 0.0, 0.0]      # calls, bytes, seconds, blocked seconds

    def _forget(self) -> None:
        self._rows.clear()
        self._totals = [0, 0, 0.0, 0.0]

    def record(self, kind: str, ranks: int, nbytes: int, seconds: float) -> None:
        """Add one call of ``kind`` on a communicator of ``ranks`` ranks that moved ``nbytes`` bytes in ``seconds``."""
        key = (kind, ranks, _bucket(nbytes))
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                row = self._rows[key] = [0, 0, 0.0]
            row[0] += 1
            row[1] += nbytes
            row[2] += seconds
            t = self._totals
            t[0] += 1
            t[1] += nbytes
            t[2] += seconds

    def add_blocked(self, seconds: float) -> None:
        """Add ``seconds`` that the calling thread waited for a collective's result."""
        with self._lock:
            self._totals[3] += seconds

    def totals(self) -> Tuple[int, int, float, float]:
        """Return (calls, bytes, seconds in collectives, seconds blocked on them) since the last clear()."""
        with self._lock:
            calls, nbytes, seconds, blocked = self._totals
        return int(calls), int(nbytes), seconds, blocked

    def rows(self) -> List[dict]:
        """Return one dict per (collective, ranks, bucket): count, bytes, mean_latency_s, algbw_gbps, busbw_gbps."""
        with self._lock:
            items = sorted(self._rows.items())
        out = []
        for (kind, ranks, bucket), (count, nbytes, seconds) in items:
            algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
            factor = bus_factor(kind, ranks)
            out.append({"collective": kind, "ranks": ranks, "bucket_bytes": bucket, "count": int(count), "bytes": int(nbytes),
                        "mean_latency_s": seconds / count, "algbw_gbps": algbw,
                        "busbw_gbps": algbw * factor if factor is not None else None})
        return out

    def table(self) -> str:
        """Return the log as a markdown table (empty string when nothing was recorded)."""
        from ...settings import format_bytes

        rows = self.rows()
        if not rows:
            return ""
        lines = ["communication log of this rank: per collective, communicator size and message size (up to)", "",
                 "| collective | ranks | size | count | total bytes | mean latency | algbw GB/s | busbw GB/s |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            busbw = f"{r['busbw_gbps']:.3f}" if r["busbw_gbps"] is not None else "-"
            lines.append(f"| {r['collective']} | {r['ranks']} | {format_bytes(r['bucket_bytes'])} | {r['count']} | "
                         f"{format_bytes(r['bytes'])} | {r['mean_latency_s'] * 1e6:.0f} us | "
                         f"{r['algbw_gbps']:.3f} | {busbw} |")
        return "\n".join(lines)
