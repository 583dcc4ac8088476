"""Gradient compression with error feedback, one implementation for PyTorch and TensorFlow.

``get("topk", ratio=0.01)`` returns a compressor; pass it as ``compression=``
to :func:`hpctrain.torch.DistributedOptimizer`,
:class:`hpctrain.tensorflow.DistributedGradientTape`,
:func:`hpctrain.tensorflow.keras.DistributedOptimizer` or
:func:`hpctrain.tensorflow.reduce_gradients`.  The protocol is in
:mod:`hpctrain.compression.base`, the collectives in
:mod:`hpctrain.compression.reducer`.  A compressor's state (error-feedback
residuals, PowerSGD's ``Q``, DGC's velocities) differs per rank: save it with
``CheckpointManager`` as ``Sharded(compressor)``.
"""
from __future__ import annotations

from typing import Dict, Optional, Type, Union

from .base import DEFAULT_SKIP_PATTERNS, Compressor, Policy, Slot
from .cast import BF16, FP16, NoCompression
from .reducer import CompressedReducer
from .powersgd import PowerSGD
from .quantize import QSGD, TernGrad
from .sign import EFSignSGD, OneBit, SignSGD
from .sparse import DGC, RandomK, Threshold, TopK

__all__ = ["get", "from_spec", "names", "gradient_compressor", "reducer_for", "REGISTRY", "Compressor", "Policy", "Slot", "CompressedReducer",
           "DEFAULT_SKIP_PATTERNS", "NoCompression", "FP16", "BF16", "TopK", "RandomK", "Threshold", "DGC",
           "QSGD", "TernGrad", "SignSGD", "EFSignSGD", "OneBit", "PowerSGD"]

REGISTRY: Dict[str, Type[Compressor]] = {cls.name: cls for cls in (
    NoCompression, FP16, BF16, TopK, RandomK, Threshold, DGC, QSGD, TernGrad, SignSGD, EFSignSGD, OneBit,
    PowerSGD)}


def names():
    """The registered compressor names."""
    return sorted(REGISTRY)


def get(name: str, **kwargs) -> Compressor:
    """A new compressor by name, e.g. ``get("powersgd", rank=2)``; unknown names and arguments raise."""
    cls = REGISTRY.get(str(name).lower())
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(names())}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise TypeError(f"compressor {name!r}: {exc}") from None


def _value(text: str):
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def from_spec(spec: str) -> Compressor:
    """A compressor from a command-line spec: ``"topk"``, ``"topk:ratio=0.01"``, ``"powersgd:rank=2,start_iter=50"``."""
    name, _, rest = str(spec).partition(":")
    kwargs = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"compressor spec {spec!r}: expected name:key=value,key=value, got {part!r}")
        kwargs[key.strip()] = _value(val)
    return get(name.strip(), **kwargs)


def gradient_compressor(op: str, compression: Union[None, str, Compressor]) -> Optional[Compressor]:
    """Check what an adapter's gradient averaging was given: op avg/sum; a compressor, its name, or None."""
    if op not in ("avg", "sum"):
        raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
    if compression is None or isinstance(compression, Compressor):
        return compression
    if isinstance(compression, str):
        return get(compression)
    raise TypeError(f"compression must be None, a compressor name ({', '.join(names())}) or a "
                    f"hpctrain.compression compressor, got {type(compression).__name__}")


def reducer_for(compressor: Compressor, comm, policy: Optional[Policy] = None) -> CompressedReducer:
    """The :class:`CompressedReducer` of ``compressor`` on ``comm`` (made once, then reused: it keeps the stats)."""
    cache = compressor.__dict__.setdefault("_reducers", {})
    key = id(comm)
    reducer = cache.get(key)
    if reducer is None or reducer.comm is not comm:
        reducer = cache[key] = CompressedReducer(compressor, comm, policy)
    elif policy is not None:
        reducer.policy = policy
    return reducer
