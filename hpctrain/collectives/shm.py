"""Intra-node collectives over shared memory, and the hierarchical all-reduce built on them.

The ranks of one node share a memory arena (an MPI-3 shared window, see
:mod:`hpctrain.comm.backends.mpi.node`): each rank has an *input* area of ``N`` elements
and a *result* area of one segment.  With ``P`` reducing ranks and the buffer
split into ``P`` segments (``segment_bounds``):

1. every rank copies the parts of its input that other ranks reduce into its
   input area (casting to the accumulation dtype); fence;
2. reducing rank ``p`` reads segment ``p`` of every rank's input straight from
   the peers' memory and writes ``x_0 (op) x_1 (op) ... (op) x_{L-1}`` (local
   ranks in order, its own input read from private memory) into its result
   area; in the hierarchical form it then all-reduces that segment with the
   ranks of the same local rank on the other nodes (a ring); fence;
3. every rank copies all ``P`` result segments into its output.

Each element is reduced once, in one fixed order, and then copied, so all
ranks get bit-identical results and the same inputs give the same bits on
every run; on one node the result equals ``((x_0 op x_1) op x_2) ...`` in rank
order, whatever the segmentation.

Cost per rank for ``N`` elements on ``L`` local ranks: writes ``(L-1)/L N``
(inputs), reads ``N`` and writes ``N/L`` (reduction), reads and writes ``N``
(results): about 2.5 memory passes, against 2 for a plain memcpy; no data
crosses a network and no message is sent on the node.  Synchronisation: two
fences per call, which suffice because input and result areas sit at fixed
places (the two halves of each rank's part of the arena): the next call
writes inputs only after this call's second fence, when every rank has
finished reading inputs, and writes results only after its own first fence,
when every rank has finished reading this call's results.  Memory: the arena
holds ``2 max(N, N/P)`` elements per rank; larger buffers go through it in
pieces (``HPCTRAIN_SHM_ARENA_BYTES``, default 64 MiB; a larger arena means
fewer fences, a smaller one less memory).

Where the ranks may copy straight between each other's private memory (Linux
cross-memory attach), :func:`shm_allreduce_direct` does the same reduction
without the arena: each rank reads its segment of every peer's input and
writes its reduced segment into every peer's output, one memcpy's traffic.

The arena ``sh`` needs ``rank``, ``size``, ``views(n_in, n_res, dtype)``
(returning one ``(input, result)`` pair of numpy views per local rank, growing
the arena when needed), ``fence()`` (all local ranks arrive, memory
synchronised) and ``max_elems(itemsize)`` (the largest piece it takes).
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, ContextManager, Optional, Sequence

import numpy as np

from .cost_model import LinkModel, hierarchical_cost
from .flat import Flat
from .ops import divide, pairwise, segment_bounds
from .registry import ONE_NODE, Algorithm, register
from .ring import ring_allreduce

__all__ = ["shm_allreduce", "shm_allreduce_direct", "shm_allreduce_small", "shm_allreduce_shared_buffer",
           "shm_reduce_scatter", "shm_allgather"]

_BLOCK_BYTES = 1 << 18   # reduce in cache-sized blocks: the output block stays in cache across the inputs
_OFF = contextlib.nullcontext()

# ``phase(name)``: a context manager around one phase of the algorithm (the communicator's
# ``timeline.phase``, which records it while the timeline is on); the default records nothing.
Phase = Callable[[str], ContextManager]
COPY_IN, FENCE, REDUCE = "shm copy in", "shm fence (waiting for peers)", "shm reduce (reading the peers' memory)"
CROSS, COPY_OUT, TO_PEERS = "ring across nodes (transfer, reduce)", "shm copy out", "shm copy to the peers"


def no_phase(name: str) -> ContextManager:
    """The ``phase`` that records nothing."""
    return _OFF


def _reduce_segment(inputs, own: int, own_block, lo: int, hi: int, out: np.ndarray, op: str,
                    divisor: int = 1) -> None:
    """Write ``(inputs[0][lo:hi] (op) inputs[1][lo:hi] ...) / divisor`` into ``out`` (input ``own``: ``own_block``).

    The division (``avg``) happens block by block while the block is in cache:
    no pass of its own over the result.
    """
    ufunc = pairwise(op, out.dtype)
    step = max(1, _BLOCK_BYTES // out.itemsize)
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        o = out[a - lo:b - lo]
        srcs = [own_block(a, b) if j == own else inp[a:b] for j, inp in enumerate(inputs)]
        if len(srcs) == 1:
            np.copyto(o, srcs[0], casting="unsafe")
        else:
            ufunc(srcs[0], srcs[1], out=o, casting="unsafe")
        for src in srcs[2:]:
            ufunc(o, src, out=o, casting="unsafe")
        if divisor > 1:
            _divide(o, divisor)


def _divide(a: np.ndarray, divisor: int) -> None:
    """Divide ``a`` in place by ``divisor`` (the ``avg`` of :func:`hpctrain.collectives.ops.finish`, same bits)."""
    divide(a, divisor, a)


def _reduce_own(x: Flat, base: int, N: int, bounds, views, res: np.ndarray, op: str, sh, divisor: int = 1,
                phase: Phase = no_phase) -> None:
    """Run steps 1-2 on elements ``[base, base + N)`` of ``x``: publish all but the own segment, fence, reduce it.

    The own segment's reduction, divided by ``divisor``, goes into ``res``; a
    rank past the reducing ones (``rank >= len(bounds) - 1``) only publishes.
    """
    r = sh.rank
    reducing = r < len(bounds) - 1
    lo, hi = (int(bounds[r]), int(bounds[r + 1])) if reducing else (0, 0)
    own_in = views[r][0]
    with phase(COPY_IN):
        x.read(base, base + lo, own_in[:lo])
        x.read(base + hi, base + N, own_in[hi:N])
    with phase(FENCE):
        sh.fence()
    if reducing and hi > lo:
        scratch = np.empty(min(hi - lo, _BLOCK_BYTES // res.itemsize), dtype=x.arrays[0].dtype)
        with phase(REDUCE):
            _reduce_segment([v[0][:N] for v in views], r, lambda a, b: x.block(base + a, base + b, scratch),
                            lo, hi, res, op, divisor)


def _piece(x: Flat, out: Flat, base: int, N: int, dtype, op: str, sh, parts: int, cross, chunk_elems: int,
           divisor: int, phase: Phase) -> None:
    """All-reduce elements ``[base, base + N)`` of ``x`` into the same elements of ``out``."""
    r = sh.rank
    bounds = segment_bounds(N, parts)
    views = sh.views(N, int(np.max(np.diff(bounds))), dtype)
    res = views[r][1][:int(bounds[r + 1] - bounds[r])] if r < parts else None
    _reduce_own(x, base, N, bounds, views, res, op, sh, 1 if cross is not None else divisor, phase)  # the node
    if cross is not None and res is not None and res.size:
        with phase(CROSS):
            ring_allreduce(res, op, cross, chunk_elems)          # across nodes
            if divisor > 1:
                _divide(res, divisor)
    with phase(FENCE):
        sh.fence()
    with phase(COPY_OUT):
        for p in range(parts):                                   # 3. collect every segment
            a, b = int(bounds[p]), int(bounds[p + 1])
            out.write(base + a, base + b, views[p][1][:b - a])


def shm_allreduce(x: Flat, out: Flat, op: str, sh, parts: Optional[int] = None, cross=None,
                  chunk_elems: int = 1 << 18, divisor: int = 1, phase: Phase = no_phase) -> None:
    """All-reduce the flat buffer ``x`` into ``out`` (same length, the accumulation dtype); see module docstring.

    Formula: ``out = (x_0 (op) ... (op) x_{n-1}) / divisor`` (``divisor`` is
    the world size for ``avg``, else 1; each reducing rank divides its
    segment while it is in cache, so the average costs no pass of its own).
    ``x`` and ``out`` may be the same memory (in place).  Args: ``sh`` the
    node's arena; ``parts`` how many local ranks reduce (default all; the
    hierarchical form uses the smallest local size of any node so that
    every node has the same segments); ``cross`` the ring
    transport among the ranks of equal local rank on the other nodes, or None
    on one node; ``phase`` marks each piece's copy in, fences, reduction,
    ring and copy out (see ``Phase``).  Cost: see the module docstring; the
    inter-node ring moves ``2 (m-1)/m`` of one segment per rank for ``m`` nodes.
    """
    if not x.size:
        return
    parts = sh.size if parts is None else parts
    dtype = out.arrays[0].dtype
    step = max(parts, sh.max_elems(dtype.itemsize))
    for a in range(0, x.size, step):
        _piece(x, out, a, min(step, x.size - a), dtype, op, sh, parts, cross, chunk_elems, divisor, phase)


def shm_allreduce_direct(x: Flat, out: Flat, op: str, rank: int, peers, xm, block_bytes: int = 1 << 20,
                         divisor: int = 1) -> None:
    """All-reduce ``x`` into ``out`` on one node by single copies between the ranks' own memory.

    The form of :func:`shm_allreduce` for a node whose ranks can copy straight
    from and into each other's private memory (``xm``, a
    :class:`hpctrain.comm.backends.mpi.cross_memory.CrossMemory`): nothing is staged in
    the arena.  Reducing rank ``p`` takes segment ``p`` in blocks of
    ``block_bytes``: it reads the block of every peer's input into a scratch
    block (one kernel copy each), reduces them in rank order (its own input
    read from private memory), and writes the result block into its own and
    every peer's output.  Same segments and order, so the same bits as
    :func:`shm_allreduce`.

    ``peers[k]`` is ``(pid, input addresses, output addresses)`` of local rank
    ``k``: the data address of every part of its ``x`` and ``out`` (the same
    layout on every rank).  The caller exchanges them once every rank's
    input is ready (which is the first fence) and fences again afterwards,
    before any rank reads its output or reuses its input.  ``x`` and ``out``
    have one dtype and may be the same memory (in place): a rank reads and
    writes only its own segment of every peer's buffers, and reduces each
    block in a scratch block (in cache) before it writes any output.

    Formula: ``out = (x_0 (op) ... (op) x_{L-1}) / divisor`` (the division of
    each result block in cache).  Cost per rank for ``N`` elements on ``L``
    ranks: reads ``N`` (its segment of every input) and writes ``N`` (its
    segment of every output), the traffic of one memcpy, against about 2.5 memory passes for
    the arena; ``2 (L-1)`` system calls per block; no fence of its own.
    """
    L = len(peers)
    if not x.size:
        return
    bounds = segment_bounds(x.size, L)
    lo, hi = int(bounds[rank]), int(bounds[rank + 1])
    dtype = out.arrays[0].dtype
    ufunc = pairwise(op, dtype)
    step = max(1, block_bytes // dtype.itemsize)
    n = min(step, hi - lo)
    acc_block, peer_block, own_copy = (np.empty(n, dtype=dtype) for _ in range(3))
    for a in range(lo, hi, step):
        b = min(a + step, hi)
        x_spans, t = x.spans(a, b), acc_block[:b - a]
        acc = None                                          # x_0 (op) ... (op) x_k so far
        for k, (pid, x_addresses, _) in enumerate(peers):
            if k == rank:
                src = x.block(a, b, own_copy)               # own input where it is, or copied when it spans parts
            else:
                src = t if acc is None else peer_block[:b - a]
                xm.read(pid, x.byte_spans(x_spans, x_addresses), src)
            if acc is None:
                acc = src
            else:
                ufunc(acc, src, out=t)
                acc = t
        if divisor > 1:
            divide(acc, divisor, t)                         # (the bits of ops.finish)
            acc = t
        out.write(a, b, acc)                                # every input block is read: in place is safe
        out_spans = out.spans(a, b)
        for k, (pid, _, out_addresses) in enumerate(peers):
            if k != rank:
                xm.write(pid, out.byte_spans(out_spans, out_addresses), acc)


def shm_allreduce_small(inputs: Sequence[np.ndarray], out: np.ndarray, op: str) -> None:
    """Write ``inputs[0] (op) inputs[1] (op) ...`` (every local rank's buffer, in rank order) into ``out``.

    The all-reduce of small buffers on one node: the inputs arrived in shared
    memory with the call check (:class:`hpctrain.comm.backends.mpi.mailbox.Mailbox`), and
    every rank reduces all of them itself instead of one segment each, which
    saves both fences and the copy of the results.  Same order, so the same
    bits as :func:`shm_allreduce`.  Cost per rank for ``N`` elements on ``L``
    ranks: reads ``L N``, writes ``N``; no synchronisation.  ``inputs`` and
    ``out`` share one shape and dtype (the buffers fit a cache: no blocking).
    """
    ufunc = pairwise(op, out.dtype)
    if len(inputs) == 1:
        np.copyto(out, inputs[0])
        return
    ufunc(inputs[0], inputs[1], out=out)
    for src in inputs[2:]:
        ufunc(out, src, out=out)


def shm_allreduce_shared_buffer(buf, op: str, parts: Optional[int] = None, cross=None,
                                chunk_elems: int = 1 << 18, divisor: int = 1, phase: Phase = no_phase) -> None:
    """All-reduce, in place, a buffer that already lives in shared memory (a ``SharedBuffer``).

    Every local rank's buffer is visible to its peers, so nothing is copied in
    first: after a fence, reducing rank ``p`` reads segment ``p`` of every
    rank's buffer, reduces it in rank order into its own buffer (the
    hierarchical form then all-reduces it with the other nodes), and writes
    it into segment ``p`` of every peer's buffer; a second fence ends the call.
    No rank touches another's segment, so two fences suffice, and the result
    has the same bits as :func:`shm_allreduce`.  Cost per rank for ``N``
    elements on ``L`` ranks: reads ``N`` and writes ``N`` (one memory pass
    each way, against about 2.5 for the arena path plus the copies in and
    out of it).  Formula: ``buf = (x_0 (op) ... (op) x_{L-1}) / divisor``
    (as :func:`shm_allreduce`).
    """
    arrays, r = buf.arrays, buf.rank
    parts = len(arrays) if parts is None else parts
    n = buf.count
    with phase(FENCE):
        buf.fence()                                              # every input is complete
    if r < parts:
        bounds = segment_bounds(n, parts)
        lo, hi = int(bounds[r]), int(bounds[r + 1])
        if hi > lo:
            own = arrays[r]
            scratch = np.empty(min(hi - lo, _BLOCK_BYTES // own.itemsize), dtype=own.dtype)

            def own_block(a, b):
                np.copyto(scratch[:b - a], own[a:b])
                return scratch[:b - a]

            with phase(REDUCE):
                _reduce_segment(arrays, r, own_block, lo, hi, own[lo:hi], op, 1 if cross is not None else divisor)
            if cross is not None:
                with phase(CROSS):
                    ring_allreduce(own[lo:hi], op, cross, chunk_elems)
                    if divisor > 1:
                        _divide(own[lo:hi], divisor)
            with phase(TO_PEERS):
                for k, peer in enumerate(arrays):
                    if k != r:
                        peer[lo:hi] = own[lo:hi]
    with phase(FENCE):
        buf.fence()                                              # every segment is everywhere


def shm_reduce_scatter(x: np.ndarray, bounds: np.ndarray, acc_dtype, op: str, sh,
                       phase: Phase = no_phase) -> np.ndarray:
    """Return segment ``bounds[rank]:bounds[rank+1]`` of the reduction of flat ``x`` over the node's ranks.

    Formula: ``out = (x_0 (op) ... (op) x_{n-1})[own segment]``.  Cost: writes
    ``N - own`` and reads ``N`` elements per rank; two fences.  The segment is
    reduced in rank order, as :func:`shm_allreduce` does.  The whole buffer
    goes through the arena at once (no pieces).
    """
    r = sh.rank
    out = np.empty(int(bounds[r + 1] - bounds[r]), dtype=acc_dtype)
    views = sh.views(x.size, 0, out.dtype)
    _reduce_own(Flat([x]), 0, x.size, bounds, views, out, op, sh, phase=phase)
    with phase(FENCE):
        sh.fence()
    return out


def shm_allgather(raw: np.ndarray, counts, sh, phase: Phase = no_phase) -> np.ndarray:
    """Return the concatenation of every local rank's bytes ``raw`` (rank i has ``counts[i]`` bytes).

    Each rank writes its bytes into its input area once; every rank copies all
    of them out.  Cost: one write of the own bytes and one read of all bytes
    per rank; two fences; the arena grows to the largest contribution.
    """
    widest = max(counts) if counts else 0
    views = sh.views(widest, 0, np.uint8)
    with phase(COPY_IN):
        views[sh.rank][0][:raw.size] = raw
    with phase(FENCE):
        sh.fence()
    out = np.empty(sum(counts), dtype=np.uint8)
    offset = 0
    with phase(COPY_OUT):
        for k, c in enumerate(counts):
            out[offset:offset + c] = views[k][0][:c]
            offset += c
    with phase(FENCE):
        sh.fence()
    return out


# Both run inside the MPI backend on its node windows (``run`` None).  Their cost estimates are the
# crossovers ``hpctrain tune`` measures against the library call: on one node "shm" is cheaper for
# small buffers (one exchange through the mailbox) and from HPCTRAIN_SHM_MIN_BYTES on (its default, 0:
# chosen here, then measured against the library on the first calls, hpctrain.comm.call.measured_choice); across nodes
# "hierarchical" is cheaper from HPCTRAIN_HIERARCHICAL_MIN_BYTES on where that is set (measured), else
# where the cost model says it is (cost_model.py, its constants from HPCTRAIN_LINK_GBIT,
# HPCTRAIN_LINK_LATENCY_US and HPCTRAIN_MEMORY_GBPS).
# A small all-reduce carried by the call check has every rank read every rank's payload: the node moves
# ``L * L * N`` bytes between its cores for ``N`` bytes on ``L`` ranks, against about ``2 L N`` for the
# library's algorithms.  Up to this much the single exchange wins; beyond it the library does (on a
# 16-core node: 16 ranks x 4 KiB and 2 x 64 KiB ride at 1.05x and 1.2x of MPI_Allreduce's time,
# 8 x 64 KiB would take 1.9x where the library call with the check takes 1.1x).  More local ranks than
# the machine has cores always ride: the library's busy polls there take the core from the rank waited for.
CARRIED_TRAFFIC_BYTES = 2 << 20


def carried_by_check(where, nbytes: int) -> bool:
    """Whether ``auto`` lets the call check carry a small one-node all-reduce (see ``CARRIED_TRAFFIC_BYTES``)."""
    local = -(-where.size // max(where.num_nodes, 1))
    return local * local * nbytes <= CARRIED_TRAFFIC_BYTES or _oversubscribed(local)


def _oversubscribed(local_size: int) -> bool:
    # (the machine's count, not this rank's affinity: every rank of the node must decide alike)
    return (os.cpu_count() or 1) < local_size


def _shm_cost(where, nbytes):
    cfg = where.config
    if nbytes <= cfg.shm_small_bytes:
        return 0.5 if carried_by_check(where, nbytes) else 2.0
    return 0.5 if nbytes >= cfg.shm_min_bytes else 2.0


def _hierarchical_cost(where, nbytes):
    if where.num_nodes == 1:
        return None
    cfg = where.config
    if cfg.hierarchical_min_bytes:
        return 0.5 if nbytes >= cfg.hierarchical_min_bytes else 2.0
    return hierarchical_cost(LinkModel.from_config(cfg), nbytes, where.num_nodes, -(-where.size // where.num_nodes))


register(Algorithm("shm", "allreduce", backends=("mpi",), layouts=(ONE_NODE,), shared_memory=True, cost=_shm_cost,
                   summary="one node: reduce through shared memory, each element once in rank order"))
register(Algorithm("hierarchical", "allreduce", backends=("mpi",), shared_memory=True, cost=_hierarchical_cost,
                   summary="shared memory on each node, a ring across nodes between the nodes' segments"))
