"""Recursive doubling all-reduce over point-to-point messages: few exchanges of the whole buffer, for small ones.

With ``n`` ranks and ``p`` the largest power of two not above ``n``:

1. the ``n - p`` ranks from ``p`` on send their buffer to rank ``r - p``,
   which reduces it into its own;
2. ranks ``0 .. p-1``, steps ``k = 0 .. log2(p) - 1``: exchange the whole
   buffer with rank ``r XOR 2^k`` and reduce what arrived into the own
   (``acc = acc (op) other``);
3. ranks ``0 .. n-p-1`` send the result to rank ``r + p``.

Each pair computes ``a (op) b`` and ``b (op) a``, the same bits for every op
here (sum, product, min and max commute exactly), so every rank ends with
the same result, and the same inputs give the same bits on every run.

Cost: ``log2 p`` exchanges of ``N`` elements (plus two for ``n`` not a power
of two) and as many reductions of ``N``: against a ring's ``2 (n-1)``
exchanges of ``N / n``, it wins where latency, not bytes, dominates (small
buffers across nodes).  ``auto`` takes it only across nodes in a world that
re-forms, for buffers up to ``DOUBLING_MAX_BYTES``: there the library's call
is left out (see ``native.py``), and this is what the library would run.
"""
from __future__ import annotations

import numpy as np

from .ops import reduce_into
from .registry import Algorithm, register

__all__ = ["doubling_allreduce", "DOUBLING_MAX_BYTES"]

DOUBLING_MAX_BYTES = 64 << 10


def doubling_allreduce(acc: np.ndarray, op: str, t) -> np.ndarray:
    """All-reduce the flat buffer ``acc`` in place by recursive doubling over transport ``t`` and return it."""
    n, r = t.size, t.rank
    if n == 1 or acc.size == 0:
        return acc
    p = 1 << (n.bit_length() - 1)
    tmp = np.empty_like(acc)
    if r >= p:                                  # an extra rank: hand over, then take the result
        t.waitall([t.isend(acc, r - p)])
        t.waitall([t.irecv(acc, r - p)])
        return acc
    if r < n - p:
        t.waitall([t.irecv(tmp, r + p)])
        reduce_into(acc, tmp, op)
    k = 1
    while k < p:
        partner = r ^ k
        t.waitall([t.irecv(tmp, partner), t.isend(acc, partner)])
        reduce_into(acc, tmp, op)
        k <<= 1
    if r < n - p:
        t.waitall([t.isend(acc, r + p)])
    return acc


def _run(links, acc: np.ndarray, op: str) -> np.ndarray:
    with links.phase("recursive doubling (transfer, reduce)"):
        return doubling_allreduce(acc, op, links.transport)


def _cost(where, nbytes):
    # (below the ring's 1.0, which stands in for the library's call there: see ring.py)
    return 0.9 if where.reforms and where.num_nodes > 1 and nbytes <= DOUBLING_MAX_BYTES else None


# Needs point-to-point messages (not on Horovod).
register(Algorithm("doubling", "allreduce", run=_run, backends=("mpi", "local"), cost=_cost,
                   summary="recursive doubling: log2 n exchanges of the whole buffer (small buffers)"))
