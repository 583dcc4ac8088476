"""Ring all-reduce: reduce-scatter then all-gather around a ring of point-to-point messages.

With ``n`` ranks and a buffer of ``N`` elements split into ``n`` segments
(``segment_bounds``), rank ``r`` sends to ``r+1`` and receives from ``r-1``:

* reduce-scatter, steps ``s = 0 .. n-2``: send segment ``(r-s-1) mod n``,
  receive segment ``(r-s-2) mod n`` and reduce it into the local copy.  After
  ``n-1`` steps rank ``r`` holds the full reduction of segment ``r``.
* all-gather, steps ``s = 0 .. n-2``: send segment ``(r-s) mod n``, receive
  segment ``(r-s-1) mod n`` in place.

Cost: each rank sends and receives ``2 (n-1)/n * N`` elements in ``2 (n-1)``
steps (bandwidth-optimal), and does ``(n-1)/n * N`` element reductions.  Each
reduce-scatter step is chunked (``chunk_elems``): all receives and sends of a
step are posted at once and each chunk is reduced as soon as it arrives, so
the numpy reduction of chunk ``k`` overlaps the transfer of chunk ``k+1``.
Tuning: chunks of 256 KiB - 4 MiB; smaller ones add per-message overhead,
larger ones reduce the overlap.

Every element of the result is reduced in one fixed order (starting at the
segment's successor and going around the ring) and then copied to all ranks,
so all ranks get bit-identical results and the same inputs give the same bits
on every run.  It is correct for any ``N`` (0, 1, fewer elements than ranks,
not divisible by ``n``).

The transport ``t`` needs ``rank``, ``size``, ``isend(buf, dest)``,
``irecv(buf, source)`` (both returning requests) and ``waitall(requests)``;
messages between two ranks must arrive in the order they were sent (MPI
guarantees this on one communicator and tag).
"""
from __future__ import annotations

import numpy as np

from .ops import reduce_into, segment_bounds
from .registry import Algorithm, register

__all__ = ["ring_allreduce", "ring_reduce_scatter", "ring_allgather_segments"]

DEFAULT_CHUNK_BYTES = 1 << 20


def _chunks(length: int, chunk: int):
    return [(a, min(a + chunk, length)) for a in range(0, length, chunk)]


def ring_reduce_scatter(acc: np.ndarray, bounds: np.ndarray, op: str, t, chunk_elems: int) -> None:
    """Reduce ``acc`` across the ring so that rank r's segment ``bounds[r]:bounds[r+1]`` is complete.

    Args:
        acc: flat accumulation buffer, modified in place (only the own
            segment is meaningful afterwards).
        bounds: ``n+1`` element offsets of the segments.
        op: a reduction op name of :mod:`hpctrain.collectives.ops`.
        t: the point-to-point transport (see module docstring).
        chunk_elems: elements per message.
    """
    n, r = t.size, t.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    widest = int(np.max(np.diff(bounds)))
    tmp = np.empty(widest, dtype=acc.dtype)
    for s in range(n - 1):
        send_seg, recv_seg = (r - s - 1) % n, (r - s - 2) % n
        slo, shi = bounds[send_seg], bounds[send_seg + 1]
        rlo, rhi = bounds[recv_seg], bounds[recv_seg + 1]
        recv_chunks = _chunks(int(rhi - rlo), chunk_elems)
        recvs = [t.irecv(tmp[a:b], left) for a, b in recv_chunks]
        sends = [t.isend(acc[slo + a:slo + b], right) for a, b in _chunks(int(shi - slo), chunk_elems)]
        for (a, b), req in zip(recv_chunks, recvs):
            t.waitall([req])
            reduce_into(acc[rlo + a:rlo + b], tmp[a:b], op)
        t.waitall(sends)


def ring_allgather_segments(buf: np.ndarray, bounds: np.ndarray, t) -> None:
    """Circulate the segments so that every rank ends with all of them (in place).

    Before: rank r's segment ``bounds[r]:bounds[r+1]`` of ``buf`` is valid.
    After: all of ``buf`` is valid on every rank.  Cost: ``(n-1)/n * N`` elements
    sent and received per rank, in ``n-1`` steps.
    """
    n, r = t.size, t.rank
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_seg, recv_seg = (r - s) % n, (r - s - 1) % n
        reqs = []
        if bounds[recv_seg + 1] > bounds[recv_seg]:
            reqs.append(t.irecv(buf[bounds[recv_seg]:bounds[recv_seg + 1]], left))
        if bounds[send_seg + 1] > bounds[send_seg]:
            reqs.append(t.isend(buf[bounds[send_seg]:bounds[send_seg + 1]], right))
        t.waitall(reqs)


def ring_allreduce(acc: np.ndarray, op: str, t, chunk_elems: int) -> np.ndarray:
    """All-reduce the flat buffer ``acc`` in place around the ring and return it.

    Formula: ``out = x_0 (op) x_1 (op) ... (op) x_{n-1}`` element-wise (``avg``
    is finished by the caller).  Cost: ``2 (n-1)/n * N`` elements sent per
    rank in ``2 (n-1)`` steps; memory: one extra segment.
    """
    if t.size == 1 or acc.size == 0:
        return acc
    bounds = segment_bounds(acc.size, t.size)
    ring_reduce_scatter(acc, bounds, op, t, chunk_elems)
    ring_allgather_segments(acc, bounds, t)
    return acc


def _run(links, acc: np.ndarray, op: str) -> np.ndarray:
    t = links.transport
    if t.size == 1 or acc.size == 0:
        return acc
    bounds = segment_bounds(acc.size, t.size)
    with links.phase("ring reduce-scatter (transfer, reduce)"):
        ring_reduce_scatter(acc, bounds, op, t, links.chunk_elems(acc.itemsize))
    with links.phase("ring all-gather (transfer)"):
        ring_allgather_segments(acc, bounds, t)
    return acc


def _reduce_scatter(links, acc: np.ndarray, bounds: np.ndarray, op: str) -> np.ndarray:
    with links.phase("ring reduce-scatter (transfer, reduce)"):
        ring_reduce_scatter(acc, bounds, op, links.transport, links.chunk_elems(acc.itemsize))
    return acc[bounds[links.rank]:bounds[links.rank + 1]]


def _cost(where, nbytes):
    # The library's call (1.0) where it runs: the tuned library call or the shared-memory algorithms are at
    # least as fast.  Across nodes in a world that re-forms the library's call is left out (not fault
    # tolerant, see native.py) and the ring stands in for it.
    return 1.0 if where.reforms and where.num_nodes > 1 else None


# Needs point-to-point messages (not on Horovod).
register(Algorithm("ring", "allreduce", run=_run, reduce_scatter=_reduce_scatter, backends=("mpi", "local"),
                   cost=_cost, summary="hpctrain's ring: reduce-scatter + all-gather, 2 (n-1)/n of the bytes per rank"))
