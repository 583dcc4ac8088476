"""Stochastic quantizers: unbiased, so they need no error feedback.

Each rank scales by its own norm, so payloads cannot be summed on the wire:
they are all-gathered and every rank decompresses and averages them.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from .base import Compressor, Slot

__all__ = ["QSGD", "TernGrad"]


class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): ``s`` levels of ``|x| / ||x||_2``, rounded at random.

    ``q_i = sign(x_i) floor(s |x_i| / ||x|| + u_i)``, ``u_i ~ U[0, 1)``;
    ``x_hat = ||x|| q / s``, so ``E[x_hat] = x``; variance at most
    ``min(n / s^2, sqrt(n) / s) ||x||^2``.  Wire: one float32 norm plus one
    int8 per value (int16 when ``levels > 127``): 4x fewer bytes than fp32.
    Tuning: ``levels`` 16-127; fewer levels add variance.
    """

    name = "qsgd"
    keeps_state = True
    communication = "allgather"

    def __init__(self, levels: int = 127, error_feedback=None, seed: int = 0):
        super().__init__(error_feedback, seed)
        if not isinstance(levels, (int, np.integer)) or not 1 <= levels <= 32767:
            raise ValueError(f"levels must be an int in [1, 32767], got {levels!r}")
        self.levels = int(levels)
        self.wire = np.int8 if self.levels <= 127 else np.int16

    def _describe(self) -> str:
        return f"levels={self.levels}, " + super()._describe()

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        norm = np.float32(np.linalg.norm(x))
        if norm == 0:
            return [np.zeros(1, np.float32), np.zeros(x.size, self.wire)], None
        u = slot.rng(self.seed, shared=False).random(x.size, dtype=np.float32)
        level = np.floor(np.abs(x) * (np.float32(self.levels) / norm) + u)
        np.minimum(level, self.levels, out=level)
        return [np.array([norm], np.float32), (np.sign(x) * level).astype(self.wire)], None

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        norm, q = payload
        return q.astype(np.float32) * (np.float32(norm[0]) / np.float32(self.levels))


class TernGrad(Compressor):
    """TernGrad (Wen et al. 2017): each value becomes ``s * {-1, 0, 1}``, ``s = max |x|``.

    ``q_i = sign(x_i) b_i``, ``b_i ~ Bernoulli(|x_i| / s)``; ``x_hat = s q``,
    so ``E[x_hat] = x``.  Wire: one float32 scale plus one int8 per value
    (2 bits would do; int8 keeps decoding a single numpy pass).  Tuning: the
    paper clips gradients to 2.5 standard deviations first to cut variance.
    """

    name = "terngrad"
    keeps_state = True
    communication = "allgather"

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        scale = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
        if scale == 0:
            return [np.zeros(1, np.float32), np.zeros(x.size, np.int8)], None
        keep = slot.rng(self.seed, shared=False).random(x.size, dtype=np.float32) < np.abs(x) / scale
        return [np.array([scale], np.float32), (np.sign(x) * keep).astype(np.int8)], None

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        scale, q = payload
        return q.astype(np.float32) * np.float32(scale[0])
