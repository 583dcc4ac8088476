"""Adasum of the ranks' updates: the framework-neutral core of every ``op="adasum"`` optimizer.

An Adasum optimizer (Maleki et al. 2021; Horovod's ``DistributedOptimizer(op=hvd.Adasum)``)
lets each rank take its own optimizer step on its own gradients, then
combines the parameter *deltas* with Adasum instead of averaging gradients::

    start   = the parameters before the step (equal on every rank)
    delta_r = local_step_r(start) - start          (rank r's optimizer: SGD, momentum, Adam, ...)
    new     = start + adasum(delta_0, ..., delta_{N-1})      (per tensor, on every rank)

Adasum averages the parts of the deltas that point the same way and adds
the orthogonal parts (:mod:`hpctrain.collectives.adasum`), so the learning
rate is *not* scaled by the number of ranks.  The optimizer's own state
(momentum, Adam's moments) stays local to each rank, as in Horovod.  After
the combination every rank holds the same parameters.

:class:`AdasumUpdates` packs the deltas into one buffer and combines them
in one reduction, each tensor with its own coefficients; the framework
adapters (:mod:`hpctrain.torch.adasum_optimizer`,
:mod:`hpctrain.tensorflow.adasum_apply`) only take the snapshot, run the local
step and write ``start + combined`` back.  Gradient Adasum (a
``DistributedGradientTape`` with ``op="adasum"``) uses :meth:`AdasumUpdates.combine`
on the gradients instead.

Compression: ``"fp16"`` (Horovod's ``Compression.fp16``) sends the deltas
as float16 (the coefficients are still computed in float64, the result is
rounded to float16 and widened again); other compressors sum or average
and are refused.  On one rank nothing is combined: the step is the local
optimizer's, bit for bit.

Cost per step: one copy of the parameters (the snapshot), one Adasum
reduction of all of them (about ``(log2 N + 1)`` x their bytes on the
critical path; :func:`~hpctrain.collectives.adasum.adasum_allreduce`), and
the packing copies.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np


__all__ = ["AdasumUpdates", "adasum_wire_dtype"]


def adasum_wire_dtype(compression: Any) -> Optional[np.dtype]:
    """The dtype Adasum sends for ``compression`` (None: the values' own); ValueError for a compressor it cannot use."""
    if compression is None or compression == "none":
        return None
    name = compression if isinstance(compression, str) else getattr(compression, "name", type(compression).__name__)
    if str(name).lower() in ("fp16", "float16", "fp16compressor"):
        return np.dtype(np.float16)
    raise ValueError(f"op='adasum' combines updates by their directions, which a summing compressor ({name}) "
                     f"cannot carry: use compression=None or 'fp16' (hvd.Compression.fp16)")


class AdasumUpdates:
    """Combine every rank's list of update tensors with Adasum, tensor by tensor, in one reduction.

    Args:
        comm: the communicator (default: the world); its ``adasum_allreduce(x, segments)`` runs the
            reduction (hpctrain.horovod's negotiated one negotiates it).
        compression: None or ``"fp16"`` (see the module docstring).
    """

    def __init__(self, comm=None, compression: Any = None):
        from . import settings
        from .world import comm_or_world

        if comm is None:
            settings.refuse_under_elastic(
                "op='adasum'", "each rank's optimizer state is its own, and which survivor takes a lost rank's is "
                "not defined", "launch without --elastic and resume from its checkpoints, or train elastically "
                "with op='avg'")
        self.comm = comm_or_world(comm)
        self.wire = adasum_wire_dtype(compression)
        self.compressor = None if self.wire is None else "fp16"
        self.steps = 0
        self._sent = 0

    @property
    def communicates(self) -> bool:
        """Whether there is anyone to combine with."""
        return self.comm.size > 1

    def combine(self, arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
        """Return the Adasum over ranks of each array (same shapes and dtypes on every rank); counts a step."""
        self.steps += 1
        arrays = [np.asarray(a) for a in arrays]
        if not self.communicates or not arrays:
            return list(arrays)
        for a in arrays:
            if a.dtype.kind != "f":
                raise TypeError(f"Adasum needs floating-point tensors, got {a.dtype}")
        wire = self.wire or np.result_type(*arrays)
        lengths = [a.size for a in arrays]
        keep = [i for i, n in enumerate(lengths) if n]
        flat = np.concatenate([arrays[i].reshape(-1) for i in keep]).astype(wire, copy=False) if keep \
            else np.zeros(0, wire)
        out = [np.array(a, copy=True) for a in arrays]
        if flat.size:
            self._sent += flat.nbytes
            segments = [lengths[i] for i in keep]
            combined = self.comm.adasum_allreduce(flat, segments)
            off = 0
            for i in keep:
                out[i] = combined[off:off + lengths[i]].reshape(arrays[i].shape).astype(arrays[i].dtype)
                off += lengths[i]
        return out

    def count_step(self) -> None:
        """Count a step that combined nothing (one rank)."""
        self.steps += 1

    def stats(self) -> Dict[str, Any]:
        """Bytes this rank put into Adasum reductions, per step and in total (the keys of the gradient stats)."""
        per_step = self._sent / max(1, self.steps)
        ratio = 1.0 if self.wire is None else 0.5
        return {"compressor": self.compressor, "steps": self.steps, "sent_bytes": self._sent,
                "sent_bytes_per_step": per_step, "received_bytes_per_step": per_step,
                "dense_bytes_per_step": per_step / ratio, "ratio_to_fp32": ratio}
