"""Horovod's ``hvd.Compression`` interface, shared by the torch and TensorFlow modules.

``Compression.none`` and ``Compression.fp16`` (defined per framework: it
casts tensors) have Horovod's ``compress(tensor) -> (tensor, ctx)`` /
``decompress(tensor, ctx)`` interface and work on single collectives.
``Compression.hpctrain(name, **options)`` selects one of hpctrain's
compressors (:mod:`hpctrain.compression`: "topk", "powersgd", "signsgd",
...), which work on a step's gradients with error feedback, so only the
gradient wrappers (``DistributedOptimizer``, ``DistributedGradientTape``)
take it.  A compressor's ``hpctrain_name`` is what those wrappers hand to
hpctrain's gradient machinery (None: no compression there).
"""
from __future__ import annotations

__all__ = ["Compressor", "NoneCompressor", "HpctrainCompressor", "Compression", "hpctrain_compression"]


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


class HpctrainCompressor(Compressor):
    """One of hpctrain's gradient compressors, for the gradient wrappers' ``compression=``."""

    def __init__(self, name, **options):
        from ..compression import get
        self.hpctrain_name = get(name, **options) if options else name
        self.name = name

    def compress(self, tensor):
        raise TypeError(f"hpctrain's {self.name!r} compressor works on a step's gradients: pass it to "
                        f"hvd.DistributedOptimizer (or hvd.DistributedGradientTape), not to a single collective")

    decompress = compress


class Compression:
    """The compressors, as Horovod names them (each framework adds its ``fp16``)."""

    none = NoneCompressor

    @staticmethod
    def hpctrain(name, **options) -> HpctrainCompressor:
        """Return hpctrain's compressor ``name`` (see :mod:`hpctrain.compression`) for gradient reduction."""
        return HpctrainCompressor(name, **options)


def hpctrain_compression(compression):
    """Return the compressor (name) a gradient wrapper hands to hpctrain for Horovod's ``compression=``.

    Raises TypeError for anything but a Compression member or
    ``Compression.hpctrain(...)``, and ValueError for a compressor without a
    gradient form.
    """
    if compression is None or compression is NoneCompressor:
        return None
    ok = isinstance(compression, Compressor) or (isinstance(compression, type) and issubclass(compression, Compressor))
    if not ok:
        raise TypeError("compression must be hvd.Compression.none, hvd.Compression.fp16 or "
                        "hvd.Compression.hpctrain(name)")
    if compression.hpctrain_name is None:
        raise ValueError(f"{compression} has no gradient form; use Compression.fp16 or Compression.hpctrain(name)")
    return compression.hpctrain_name
