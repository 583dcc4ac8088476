"""Average scalar metrics (loss, accuracy, counts) over ranks, for any framework."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

import numpy as np

__all__ = ["average_metrics"]


def _scalar(v: Any) -> float:
    """A Python float from a float, int, numpy scalar, 0-d torch tensor or TensorFlow scalar."""
    if hasattr(v, "item"):          # numpy, torch
        return float(v.item())
    if hasattr(v, "numpy"):         # TensorFlow eager tensors and variables
        return float(v.numpy())
    return float(v)


def average_metrics(metrics: Mapping[str, Any], comm: Optional[Any] = None) -> Dict[str, float]:
    """Return ``{name: mean over ranks of metrics[name]}`` for scalar values, in one all-reduce.

    Formula: ``out[k] = (1/N) sum_r metrics_r[k]``, in float64.  Every rank
    must pass the same names (the all-reduce's call check names the ranks that
    do not).  Cost: one all-reduce of ``len(metrics)`` float64 values.
    """
    from .world import comm_or_world

    names = sorted(metrics)
    vals = np.array([_scalar(metrics[k]) for k in names], dtype=np.float64)
    avg = comm_or_world(comm).allreduce(vals, op="avg")
    return {k: float(v) for k, v in zip(names, avg)}
