"""One-bit compressors: a sign per value (packed 8 to a byte) and at most two floats per tensor.

Wire: ``n / 8`` bytes plus a few floats, 32x fewer than fp32; payloads are
all-gathered.  A zero counts as positive.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from .base import Compressor, Slot

__all__ = ["SignSGD", "EFSignSGD", "OneBit"]


def _bits(x: np.ndarray) -> np.ndarray:
    return np.packbits(x >= 0)


def _signs(bits: np.ndarray, n: int) -> np.ndarray:
    """+1 / -1 float32 from packed bits."""
    return np.unpackbits(bits, count=n).astype(np.float32) * 2 - 1


class SignSGD(Compressor):
    """signSGD with majority vote (Bernstein et al. 2018/2019): send signs, apply the sign of their sum.

    ``result = sign(sum_r sign(x_r))`` (0 where the vote ties), whatever the
    op: the update is ``lr * result``, so use a small learning rate (about
    that of Adam).  No error feedback (the vote needs none; see
    :class:`EFSignSGD` for a single-machine-equivalent variant).
    """

    name = "signsgd"
    communication = "allgather"

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        return [_bits(x)], None

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        return _signs(payload[0], n)

    def finish(self, total: np.ndarray, nranks: int, op: str) -> np.ndarray:
        return np.sign(total, out=total)


class EFSignSGD(Compressor):
    """EF-signSGD (Karimireddy et al. 2019): scaled signs with error feedback.

    ``x_hat = (||c||_1 / n) sign(c)`` for the compensated ``c = g + e``; the
    rest is kept in ``e``.  Averaged over ranks like an ordinary gradient, so
    it keeps SGD's learning rate.  Memory: one fp32 residual per tensor.
    """

    name = "efsignsgd"
    communication = "allgather"
    default_error_feedback = True

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        scale = np.float32(np.abs(x).mean()) if x.size else np.float32(0)
        return [np.array([scale], np.float32), _bits(x)], None

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        return _signs(payload[1], n) * np.float32(payload[0][0])


class OneBit(Compressor):
    """1-bit SGD (Seide et al. 2014): one bit per value, decoded to the mean of its side.

    ``x_hat_i = mean(c[c >= 0])`` where ``c_i >= 0`` else ``mean(c[c < 0])``,
    with error feedback (essential here).  Memory: one fp32 residual.
    """

    name = "onebit"
    communication = "allgather"
    default_error_feedback = True

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        pos = x >= 0
        npos = int(pos.sum())
        hi = np.float32(x[pos].mean()) if npos else np.float32(0)
        lo = np.float32(x[~pos].mean()) if npos < x.size else np.float32(0)
        return [np.array([hi, lo], np.float32), np.packbits(pos)], None

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        hi, lo = payload[0]
        return np.where(np.unpackbits(payload[1], count=n).astype(bool), hi, lo).astype(np.float32)
