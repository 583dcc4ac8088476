"""Horovod's ``hvd.Compression`` for torch: ``none``, ``fp16``, and hpctrain's compressors by name.

The interface and ``none``/``hpctrain(name)`` are framework-neutral
(:mod:`hpctrain.horovod.compression`); this module adds the float16 cast.
"""
from __future__ import annotations

import torch

from ..compression import Compression as _Compression
from ..compression import Compressor, HpctrainCompressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "HpctrainCompressor", "Compression"]


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (half the bytes of float32); other dtypes as they are."""

    hpctrain_name = "fp16"

    @staticmethod
    def compress(tensor):
        """Return the float16 copy of a floating-point ``tensor`` and its original dtype."""
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        """Cast back to the original dtype."""
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class Compression(_Compression):
    """The compressors, as Horovod names them."""

    fp16 = FP16Compressor
