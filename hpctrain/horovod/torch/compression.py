"""Horovod's ``hvd.Compression`` for torch: ``none``, ``fp16``, and hpctrain's compressors by name.

``Compression.none`` and ``Compression.fp16`` have Horovod's
``compress(tensor) -> (tensor, ctx)`` / ``decompress(tensor, ctx)`` interface
and work on single collectives.  ``Compression.hpctrain(name, **options)``
selects one of hpctrain's compressors (:mod:`hpctrain.compression`: "topk",
"powersgd", "signsgd", ...), which work on whole gradient buckets with error
feedback, so it is accepted by ``DistributedOptimizer`` only.
"""
from __future__ import annotations

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "HpctrainCompressor", "Compression"]


class Compressor:
    """Interface: ``compress(tensor)`` returns ``(wire tensor, ctx)``; ``decompress(wire, ctx)`` undoes it."""

    hpctrain_name = None

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor):
        """Return ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Return ``tensor`` unchanged."""
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16 (half the bytes); other dtypes as they are."""

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


class HpctrainCompressor(Compressor):
    """One of hpctrain's gradient compressors, for ``DistributedOptimizer(compression=...)``."""

    def __init__(self, name, **options):
        from ...compression import get
        self.hpctrain_name = get(name, **options) if options else name
        self.name = name

    def compress(self, tensor):
        raise TypeError(f"hpctrain's {self.name!r} compressor works on gradient buckets: pass it to "
                        f"hvd.DistributedOptimizer(compression=...), not to a single collective")

    decompress = compress


class Compression:
    """The compressors, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor

    @staticmethod
    def hpctrain(name, **options) -> HpctrainCompressor:
        """Return hpctrain's compressor ``name`` (see :mod:`hpctrain.compression`) for DistributedOptimizer."""
        return HpctrainCompressor(name, **options)
