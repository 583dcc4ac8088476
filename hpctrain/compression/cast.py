"""Casting compressors: fp16 and bf16 halve the bytes of an fp32 all-reduce.

``payload = cast(x)``; ``x_hat = float32(payload)``.  Sums of payloads are
payloads of sums (up to a rounding per hop), so they travel in one
all-reduce, 2 bytes a value on the wire: each hop adds a pair in float32 and
rounds it once to the payload's type (:mod:`hpctrain.collectives.ops`, with
its bound: ``n - 1`` roundings of at most ``u`` times the sum of the values'
magnitudes; the casts run in C: :mod:`hpctrain.half`).  Error
of the cast: relative ``u = 2^-11`` per value for fp16
(values beyond 65504, or sums beyond it, overflow to inf; below ``6e-8``
flush to zero), ``2^-8`` for bf16 (fp32's range, so no overflow).  Memory:
none beyond the payload.  Horovod's ``Compression.fp16`` and DDP's
``fp16_compress_hook``/``bf16_compress_hook`` do the same.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy as np

from ..half import narrow, widen
from ..tensors import bfloat16
from .base import Compressor, Slot

__all__ = ["NoCompression", "FP16", "BF16"]


class NoCompression(Compressor):
    """No compression: the fp32 buffer itself is the payload (the reference point)."""

    name = "none"


class _Cast(Compressor):
    wire_dtype: Any = None
    policy_exempt = True        # a cast loses too little to keep biases and norms apart

    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        return [narrow(x, self.wire_dtype)], None

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        return widen(np.asarray(payload[0])).reshape(n)


class FP16(_Cast):
    """Send float16: 2 bytes per value (Micikevicius et al. 2018, "Mixed Precision Training")."""

    name = "fp16"
    wire_dtype = np.float16


class BF16(_Cast):
    """Send bfloat16: 2 bytes per value, fp32's exponent range (Kalamkar et al. 2019)."""

    name = "bf16"

    def __init__(self, error_feedback=None, seed: int = 0):
        if bfloat16() is None:
            raise RuntimeError("bf16 compression needs the ml_dtypes package (pip install ml_dtypes)")
        super().__init__(error_feedback, seed)
        self.wire_dtype = bfloat16()
