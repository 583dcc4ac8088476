"""PowerSGD (Vogels et al. 2019): a rank-r approximation of each gradient matrix from one power iteration.

For a gradient viewed as an ``n x m`` matrix ``M`` (its first or last
dimension by the rest, see :meth:`PowerSGD.matrix_shape`),
compensated with the error-feedback residual ``C = M + E``:

1. ``P = C Q`` (``Q``: ``m x r``, the previous step's when ``warm_start``, else
   fresh Gaussian, the same on every rank); all-reduce ``P`` (sum);
2. ``P <- orthonormalize(P)`` (QR; identical on every rank, as ``P`` is);
3. ``Q = C^T P``; all-reduce ``Q`` (mean);
4. ``M_hat = P Q^T``, the average over ranks of ``P P^T C_i``; ``E <- C - M_hat``.

Wire: ``r (n + m)`` floats instead of ``n m``, in two all-reduces per step (the
``P`` of all tensors in one fused all-reduce, then the ``Q`` of all).  Memory:
``Q`` and ``E`` per tensor (``m r + n m`` floats).  Tensors with fewer than two
dimensions, or whose compression rate ``n m / (r (n + m))`` is below
``min_compression_rate``, are all-reduced exactly; so is everything before
``start_iter`` (the early steps, where gradients change fast and error
feedback would hold stale directions).

Tuning (the paper's and DDP's advice): start with ``rank=1``..``4`` and
``start_iter`` about 10% of training or the first epoch; raise the rank if
accuracy drops; keep ``warm_start`` (it makes one power iteration per step
converge across steps).  Same method as ``torch.distributed``'s
``powerSGD_hook``, written once here for both frameworks.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from .base import Compressor

__all__ = ["PowerSGD"]


def _orthonormalize(p: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``p`` (reduced QR; zero columns stay zero)."""
    if p.shape[1] == 0:
        return p
    q, r = np.linalg.qr(p.astype(np.float64))
    signs = np.sign(np.diag(r))
    signs[signs == 0] = 0.0
    return (q * signs).astype(np.float32)


class PowerSGD(Compressor):
    """Low-rank gradient compression by one step of power iteration, with error feedback."""

    name = "powersgd"
    keeps_state = True
    communication = "custom"
    default_error_feedback = True

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, error_feedback=None, seed: int = 0):
        super().__init__(error_feedback, seed)
        if not isinstance(rank, (int, np.integer)) or rank < 1:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if int(start_iter) < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        self.rank, self.start_iter = int(rank), int(start_iter)
        self.min_compression_rate, self.warm_start = float(min_compression_rate), bool(warm_start)

    def _describe(self) -> str:
        return (f"rank={self.rank}, start_iter={self.start_iter}, min_compression_rate="
                f"{self.min_compression_rate}, warm_start={self.warm_start}, error_feedback={self.error_feedback}")

    def matrix_shape(self, shape: Tuple[int, ...]) -> Tuple[int, int]:
        """``(n, m)``: the tensor as a matrix whose one side is its first or its last dimension.

        Whichever compresses more (larger ``n m / (n + m)``; the first on a
        tie): PyTorch keeps output channels first (a conv kernel ``(out, in,
        kh, kw)`` becomes ``out x in kh kw``), Keras last (``(kh, kw, in,
        out)`` becomes ``kh kw in x out``), so both frameworks approximate the
        same matrix (transposed).  ``(n, 0)`` for tensors of fewer than two dims.
        """
        if len(shape) < 2:
            return (int(np.prod(shape)) if shape else 1, 0)
        first = int(shape[0]), int(np.prod(shape[1:]))
        last = int(np.prod(shape[:-1])), int(shape[-1])
        return max((first, last), key=lambda nm: nm[0] * nm[1] / max(1, nm[0] + nm[1]))

    def compresses(self, shape: Tuple[int, ...], step: int) -> bool:
        """Whether a tensor of ``shape`` is approximated at ``step`` (else reduced exactly)."""
        n, m = self.matrix_shape(shape)
        if m == 0 or step < self.start_iter:
            return False
        r = min(self.rank, n, m)
        return n * m >= self.min_compression_rate * r * (n + m)

    def exchange(self, comm, items: List[Tuple[str, np.ndarray]], op: str, totals: Dict[str, float]
                 ) -> Tuple[Any, Callable[[], None]]:
        """Compute the ``P`` of every tensor and start their all-reduce: (its handle, or None where there is none;
        the call that finishes the step, with the all-reduce of the ``Q`` s)."""
        lowrank, exact = [], []
        for name, a in items:
            slot = self.slot(name, a.shape, comm.rank)
            (lowrank if self.compresses(a.shape, slot.step) else exact).append((a, slot))
        mats, ps = [], []
        for a, slot in lowrank:
            n, m = self.matrix_shape(a.shape)
            r = min(self.rank, n, m)
            x = np.asarray(a, dtype=np.float32).reshape(n, m)
            c = self.compensate(x.reshape(-1), slot).reshape(n, m) if self.error_feedback else x.copy()
            q = slot.arrays.get("q")
            if q is None or not self.warm_start or q.size != m * r or not np.any(q):
                q = slot.arrays["q"] = slot.rng(self.seed, shared=True).standard_normal(m * r, dtype=np.float32)
            mats.append(c)
            ps.append(c @ q.reshape(m, r))
        exact_arrays = [np.ascontiguousarray(a, dtype=np.float32) for a, _ in exact]
        first = ps + exact_arrays
        sent = sum(p.nbytes for p in first)
        totals["sent_bytes"] += sent
        totals["received_bytes"] += sent
        handle = comm.grouped_allreduce_async(first, op="sum") if comm.size > 1 and first else None

        def finish() -> None:
            reduced = handle.wait() if handle is not None else first
            ortho = [_orthonormalize(p) for p in reduced[:len(ps)]]
            qs = [c.T @ p for c, p in zip(mats, ortho)]
            sent_q = sum(q.nbytes for q in qs)
            totals["sent_bytes"] += sent_q
            totals["received_bytes"] += sent_q
            if comm.size > 1 and qs:
                qs = comm.grouped_allreduce(qs, op="sum")
            for (a, slot), c, p, q in zip(lowrank, mats, ortho, qs):
                if op == "avg" and comm.size > 1:
                    q = q / np.float32(comm.size)
                approx = p @ q.T
                self.remember(c.reshape(-1), approx.reshape(-1), slot)
                slot.arrays["q"] = np.ascontiguousarray(q, dtype=np.float32).reshape(-1)
                a.reshape(-1)[...] = approx.reshape(-1)
                slot.step += 1
            for (a, slot), r in zip(exact, reduced[len(ps):]):
                out = r.reshape(-1)
                if op == "avg" and comm.size > 1:
                    out = out / np.float32(comm.size)
                a.reshape(-1)[...] = out
                slot.step += 1
        return handle, finish
