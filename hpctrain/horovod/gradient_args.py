"""Horovod's gradient-wrapper arguments mapped onto hpctrain's gradient machinery, for every framework.

``hvd.DistributedOptimizer`` (torch, Keras) and ``hvd.DistributedGradientTape``
share these arguments:

* ``compression``: ``Compression.none``, ``Compression.fp16`` or
  ``Compression.hpctrain(name)`` (:func:`hpctrain.horovod.compression.hpctrain_compression`);
* ``op``: Average, Sum, or Adasum (the optimizers combine the ranks'
  parameter deltas after a local step, :mod:`hpctrain.adasum_updates`; the
  gradient tape combines the gradients; compression none or fp16);
* ``gradient_predivide_factor`` f: Horovod scales by 1/f before and f/n after
  the sum to keep float16 sums in range; hpctrain does not scale (f is only
  checked): its float16 sums are float16 on the wire, each pair added in
  float32 and rounded, so a partial sum beyond 65504 is inf, as in Horovod
  with f = 1;
* ``process_set``: members reduce over the set's negotiated communicator;
  a rank outside the set steps on its own gradients (as Horovod's does),
  over a world of one.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..adasum_updates import adasum_wire_dtype
from ..comm.backends.local import init_world as init_local_world
from . import basics
from .basics import Average
from .compression import hpctrain_compression
from .negotiated import NegotiatedComm

__all__ = ["GradientSettings", "gradient_settings"]


class GradientSettings(NamedTuple):
    """What hpctrain's gradient wrappers take: the communicator, the compressor (name) and the op name."""

    comm: Any
    compressor: Any
    op: str


def gradient_settings(compression, op, gradient_predivide_factor, process_set) -> GradientSettings:
    """Check Horovod's arguments and return hpctrain's; ValueError/TypeError naming the bad one."""
    hop = basics.op_name(op)
    if hop not in ("avg", "sum", "adasum"):
        raise ValueError(f"gradient reduction supports op=hvd.Average, hvd.Sum or hvd.Adasum, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor}")
    compressor = hpctrain_compression(compression)
    if hop == "adasum":
        adasum_wire_dtype(compressor)          # ValueError for a compressor Adasum cannot use
    if process_set.included() is False:         # steps on its own gradients, with a runtime of its own
        comm = init_local_world(basics.controller().world.config)
    else:
        comm = NegotiatedComm(process_set)
    return GradientSettings(comm, compressor, hop)
