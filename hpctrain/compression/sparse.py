"""Sparsifying compressors: send a few coordinates and their indices.

All of them keep what they did not send in the error-feedback residual (on by
default, except unbiased random-k), so every coordinate is eventually applied.
Indices travel as uint16 for tensors of up to 65536 values, else int32 (int64
from 2^31 values); the payload of k coordinates costs ``6 k`` or ``8 k`` bytes
against ``4 n`` for fp32, so a ratio below 0.5 saves bytes.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from .base import Compressor, Slot

__all__ = ["TopK", "RandomK", "Threshold", "DGC", "scatter"]


def _index_dtype(n: int):
    """The narrowest index type for a tensor of ``n`` values: uint16, int32 or int64."""
    return np.uint16 if n <= 2 ** 16 else np.int32 if n < 2 ** 31 else np.int64


def _k_of(ratio: float, n: int) -> int:
    return min(n, max(1, int(math.ceil(ratio * n)))) if n else 0


def _check_ratio(ratio: float) -> float:
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return ratio


def scatter(values: np.ndarray, indices: np.ndarray, n: int) -> np.ndarray:
    """A dense float32 buffer of ``n`` zeros with ``values`` at ``indices``."""
    out = np.zeros(n, dtype=np.float32)
    out[indices] = values
    return out


def _largest(x: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the ``k`` largest magnitudes of ``x`` (O(n) selection)."""
    if k >= x.size:
        return np.arange(x.size, dtype=_index_dtype(x.size))
    idx = np.argpartition(np.abs(x), x.size - k)[x.size - k:]
    idx.sort()
    return idx.astype(_index_dtype(x.size))


class _Sparse(Compressor):
    communication = "allgather"
    default_error_feedback = True

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        return scatter(payload[0], payload[1], n)


class TopK(_Sparse):
    """Send the ``k = ceil(ratio n)`` largest magnitudes (Aji & Heafield 2017; Stich et al. 2018).

    ``payload = (x[I], I)`` with ``I`` the top-k indices of ``|x|``; the rest
    goes to the residual.  Wire: ``8 k`` bytes (``6 k`` for tensors of at most
    65536 values), all-gathered (``N`` times that received per rank).  Cost: an O(n) selection.  Tuning: ratio 0.01-0.001 with
    error feedback trains most CNNs to full accuracy; use a warm-up of dense
    steps (or :class:`DGC`) when it does not.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, error_feedback=None, seed: int = 0):
        super().__init__(error_feedback, seed)
        self.ratio = _check_ratio(ratio)

    def _describe(self) -> str:
        return f"ratio={self.ratio}, " + super()._describe()

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        idx = _largest(x, _k_of(self.ratio, x.size))
        return [x[idx], idx], None


class Threshold(_Sparse):
    """Send every value with ``|x| >= tau`` (Strom 2015, "Scalable distributed DNN training").

    The number of values sent varies per step and rank.  Wire: ``6`` or ``8``
    bytes per value sent.  Tuning: pick ``tau`` from the gradient scale (a fixed ``tau``
    sends nothing when gradients shrink; error feedback then accumulates them
    until they cross it).
    """

    name = "threshold"

    def __init__(self, tau: float = 1e-3, error_feedback=None, seed: int = 0):
        super().__init__(error_feedback, seed)
        if not float(tau) >= 0.0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        self.tau = float(tau)

    def _describe(self) -> str:
        return f"tau={self.tau}, " + super()._describe()

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        idx = np.flatnonzero(np.abs(x) >= self.tau).astype(_index_dtype(x.size))
        return [x[idx], idx], None


class RandomK(Compressor):
    """Send ``k = ceil(ratio n)`` coordinates chosen at random, the same on every rank (Stich et al. 2018).

    The indices come from a generator seeded by (seed, tensor, step), shared
    by all ranks, so only the values travel and they are summed by one
    all-reduce: wire ``4 k`` bytes.  Without error feedback (the default) the
    values are scaled by ``n / k``, so ``E[x_hat] = x`` (unbiased, variance
    grows as ``n / k``); with ``error_feedback=True`` they are sent unscaled
    and the rest waits in the residual.
    """

    name = "randomk"
    keeps_state = True

    def __init__(self, ratio: float = 0.01, error_feedback=None, seed: int = 0):
        super().__init__(error_feedback, seed)
        self.ratio = _check_ratio(ratio)

    def _describe(self) -> str:
        return f"ratio={self.ratio}, " + super()._describe()

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        k = _k_of(self.ratio, x.size)
        idx = np.sort(slot.rng(self.seed, shared=True).choice(x.size, size=k, replace=False)) if k else \
            np.zeros(0, dtype=np.int64)
        values = x[idx]
        if not self.error_feedback and k:
            values = values * np.float32(x.size / k)
        return [values.astype(np.float32)], idx

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        return scatter(payload[0], ctx, n)


class DGC(_Sparse):
    """Deep Gradient Compression (Lin et al. 2018): top-k of locally accumulated momentum.

    Per tensor: optional local clipping ``g <- g min(1, clip_norm / ||g||)``;
    momentum correction ``u <- m u + g``, ``v <- v + u``; send the top-k of
    ``|v|`` and zero ``u`` and ``v`` there (momentum factor masking).  The
    density ramps geometrically from 25% to ``ratio`` over ``warmup_steps``
    (the paper's exponential warm-up).  Use it with plain SGD without
    momentum: DGC applies the momentum itself.  Memory: two fp32 buffers per
    tensor.  Wire: as :class:`TopK`.  The paper clips to the global threshold
    times ``N^-1/2``; pass that product as ``clip_norm``.
    """

    name = "dgc"
    keeps_state = True
    default_error_feedback = False   # v is the feedback

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, clip_norm: Optional[float] = None,
                 warmup_steps: int = 0, seed: int = 0):
        super().__init__(False, seed)
        self.ratio = _check_ratio(ratio)
        if not 0.0 <= float(momentum) < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if clip_norm is not None and not float(clip_norm) > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        if int(warmup_steps) < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.momentum, self.clip_norm, self.warmup_steps = float(momentum), clip_norm, int(warmup_steps)

    def _describe(self) -> str:
        return f"ratio={self.ratio}, momentum={self.momentum}, clip_norm={self.clip_norm}, " \
               f"warmup_steps={self.warmup_steps}"

    def density(self, step: int) -> float:
        """The fraction of values sent at ``step``: 0.25 -> ratio geometrically during warm-up."""
        if step >= self.warmup_steps or self.ratio >= 0.25:
            return self.ratio
        return 0.25 * (self.ratio / 0.25) ** (step / self.warmup_steps)

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        g = x
        if self.clip_norm is not None:
            norm = float(np.linalg.norm(g))
            if norm > self.clip_norm:
                g = g * np.float32(self.clip_norm / norm)
        u, v = slot.array("u", x.size), slot.array("v", x.size)
        u *= np.float32(self.momentum)
        u += g
        v += u
        idx = _largest(v, _k_of(self.density(slot.step), x.size))
        values = v[idx].copy()
        u[idx] = 0
        v[idx] = 0
        return [values, idx], None
