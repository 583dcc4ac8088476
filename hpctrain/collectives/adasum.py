"""Adasum: combine gradients so that parallel directions are averaged and orthogonal ones added.

For two vectors (Maleki et al., "Scaling Distributed Training with Adaptive
Summation", 2021; Horovod's ``op=hvd.Adasum``)::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

(a coefficient stays 1 when its vector's squared norm is below 1e-8).  A
buffer that packs several tensors is combined tensor by tensor, as Horovod
does with its fused buffers: ``segments`` (the tensors' lengths, in order)
give each tensor its own dot product, norms and coefficients.  Equal
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

from typing import Optional, Sequence

import numpy as np

__all__ = ["adasum_pair", "adasum_allreduce", "adasum_reference"]

_TAG = 0x4144
_TINY = 1e-8


def _starts(size: int, segments: Optional[Sequence[int]]) -> np.ndarray:
    """The first index of each segment (one segment: the whole vector); ValueError unless they tile it."""
    if segments is None:
        return np.zeros(1, dtype=np.intp)
    lengths = np.asarray(segments, dtype=np.intp)
    if lengths.ndim != 1 or len(lengths) == 0 or (lengths <= 0).any() or int(lengths.sum()) != size:
        raise ValueError(f"Adasum segments must be positive lengths adding up to the {size} values, "
                         f"got {list(segments)[:8]}")
    return np.concatenate(([0], np.cumsum(lengths)[:-1]))


def adasum_pair(a: np.ndarray, b: np.ndarray, segments: Optional[Sequence[int]] = None) -> np.ndarray:
    """Return Adasum of two same-shape float vectors (in float64), per segment when ``segments`` are given."""
    a64, b64 = a.astype(np.float64, copy=False).ravel(), b.astype(np.float64, copy=False).ravel()
    starts = _starts(a64.size, segments)
    dot = np.add.reduceat(a64 * b64, starts)
    anorm, bnorm = np.add.reduceat(a64 * a64, starts), np.add.reduceat(b64 * b64, starts)
    with np.errstate(divide="ignore", invalid="ignore"):
        ca = np.where(anorm >= _TINY, 1.0 - dot / anorm * 0.5, 1.0)
        cb = np.where(bnorm >= _TINY, 1.0 - dot / bnorm * 0.5, 1.0)
    if len(starts) > 1:
        lengths = np.diff(np.append(starts, a64.size))
        ca, cb = np.repeat(ca, lengths), np.repeat(cb, lengths)
    return (ca * a64 + cb * b64).reshape(a.shape)


def adasum_reference(vectors, segments: Optional[Sequence[int]] = None) -> np.ndarray:
    """Return the tree combination of ``vectors`` (rank order) that :func:`adasum_allreduce` computes."""
    level = [np.asarray(v, dtype=np.float64) for v in vectors]
    d = 1
    while d < len(level):
        for r in range(0, len(level), 2 * d):
            if r + d < len(level):
                level[r] = adasum_pair(level[r], level[r + d], segments)
        d *= 2
    return level[0].astype(np.asarray(vectors[0]).dtype)


def adasum_allreduce(comm, x: np.ndarray, segments: Optional[Sequence[int]] = None) -> np.ndarray:
    """Return the Adasum of every rank's ``x`` (same shape and float dtype on every rank), on every rank.

    ``segments``: lengths of the tensors packed in ``x`` (each combined on its own; default: one tensor).
    """
    if x.dtype.kind != "f":
        raise TypeError(f"Adasum needs a floating-point tensor, got {x.dtype}")
    _starts(x.size, segments)
    n, r = comm.size, comm.rank
    if comm.backend == "horovod":        # no send/recv there
        return adasum_reference(list(comm.allgather(x.reshape(1, -1))), segments).reshape(x.shape)
    acc = x.astype(np.float64)
    d = 1
    while d < n:
        if r % (2 * d) == d:
            comm.send(acc, r - d, tag=_TAG)
            break
        if r % (2 * d) == 0 and r + d < n:
            acc = adasum_pair(acc, comm.recv(r + d, tag=_TAG), segments)
        d *= 2
    return comm.broadcast(acc, root=0).astype(x.dtype)
