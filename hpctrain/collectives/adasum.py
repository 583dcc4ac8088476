"""Adasum: combine gradients so that parallel directions are averaged and orthogonal ones added.

For two vectors (Maleki et al., "Scaling Distributed Training with Adaptive
Summation", 2021; Horovod's ``op=hvd.Adasum``)::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 when its vector's squared norm is below 1e-8).  Equal
vectors give ``a`` (their average), orthogonal ones ``a + b`` (their sum).
Over n ranks the pairs are combined in a binary tree: at distance d = 1, 2,
4, ... rank r (r a multiple of 2d) combines its vector with rank r + d's, as
long as r + d < n, so any n works (a rank without a partner passes its vector
up unchanged); rank 0 then broadcasts the result.  Dot products and norms are
taken in float64.  A communicator without point-to-point messages (the
horovod backend) all-gathers the vectors instead and every rank combines
them in the same tree, with the same bits.

Cost: ceil(log2 n) sequential steps, each sending the whole vector once,
then one broadcast: about (log2 n + 1) x the bytes of the vector on the
critical path (Horovod's CPU version halves the vector at each step instead,
which moves fewer bytes on large clusters); through the all-gather, n x the
bytes and n vectors of memory.  Floating-point tensors only.
"""
from __future__ import annotations

import numpy as np

__all__ = ["adasum_pair", "adasum_allreduce", "adasum_reference"]

_TAG = 0x4144
_TINY = 1e-8


def adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Return Adasum of two same-shape float vectors (in float64)."""
    a64, b64 = a.astype(np.float64, copy=False).ravel(), b.astype(np.float64, copy=False).ravel()
    dot = float(np.dot(a64, b64))
    anorm, bnorm = float(np.dot(a64, a64)), float(np.dot(b64, b64))
    ca = 1.0 - dot / anorm * 0.5 if anorm >= _TINY else 1.0
    cb = 1.0 - dot / bnorm * 0.5 if bnorm >= _TINY else 1.0
    return (ca * a64 + cb * b64).reshape(a.shape)


def adasum_reference(vectors) -> np.ndarray:
    """Return the tree combination of ``vectors`` (rank order) that :func:`adasum_allreduce` computes."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    d = 1
    while d < len(level):
        for r in range(0, len(level), 2 * d):
            if r + d < len(level):
                level[r] = adasum_pair(level[r], level[r + d])
        d *= 2
    return level[0].astype(np.asarray(vectors[0]).dtype)


def adasum_allreduce(comm, x: np.ndarray) -> np.ndarray:
    """Return the Adasum of every rank's ``x`` (same shape and float dtype on every rank), on every rank."""
    if x.dtype.kind != "f":
        raise TypeError(f"Adasum needs a floating-point tensor, got {x.dtype}")
    n, r = comm.size, comm.rank
    if comm.backend == "horovod":        # no send/recv there
        return adasum_reference(list(comm.allgather(x.reshape(1, -1)))).reshape(x.shape)
    acc = x.astype(np.float64)
    d = 1
    while d < n:
        if r % (2 * d) == d:
            comm.send(acc, r - d, tag=_TAG)
            break
        if r % (2 * d) == 0 and r + d < n:
            acc = adasum_pair(acc, comm.recv(r + d, tag=_TAG))
        d *= 2
    return comm.broadcast(acc, root=0).astype(x.dtype)
