"""Per-step metrics (:mod:`hpctrain.observe`) and forward spans on the timeline for a torch training loop."""
from __future__ import annotations

import time
from typing import List, Optional

import torch

from ..observe import StepMetrics

__all__ = ["trace_forward", "track_steps"]


def track_steps(optimizer: torch.optim.Optimizer, log_dir: Optional[str] = None,
                samples_per_step: Optional[int] = None, comm=None, **options) -> StepMetrics:
    """Measure every ``optimizer.step()`` as one training step; return the :class:`~hpctrain.observe.StepMetrics`.

    ::

        metrics = ht.track_steps(optimizer, log_dir="runs/x", samples_per_step=batch_size)
        ...                                   # the loop, unchanged
        bar.set_postfix(metrics.postfix())    # rank 0's tqdm bar: samples/s, communication share
        metrics.close()                       # every rank (hpctrain.shutdown() does it otherwise)

    A step ends when ``optimizer.step()`` returns (a post-step hook), so the
    step time includes the data loading, forward and backward before it.
    With a :func:`DistributedOptimizer` compressing gradients the compression
    ratio is read from it.  ``options``: the other arguments of StepMetrics.
    """
    stats = getattr(optimizer, "compression_stats", None)
    if comm is None:        # (the optimizer's group; the world is left to StepMetrics, which follows it when re-formed)
        from ..world import world

        held = getattr(getattr(optimizer, "_hpctrain", None), "comm", None)
        comm = None if held is None or held is world() else held
    metrics = StepMetrics(comm, log_dir, samples_per_step, compression=stats, **options)
    metrics.close_hooks.add(optimizer.register_step_post_hook(lambda opt, args, kwargs: metrics.mark()).remove)
    return metrics


def trace_forward(model: torch.nn.Module, comm=None) -> List:
    """Put each ``model(...)`` call on the timeline as a "forward" span (while the timeline records).

    The DistributedOptimizer already marks backward, gradient synchronisation
    and the optimizer step.  Returns the two hook handles (``.remove()``).
    Cost while the timeline is off: one attribute test per forward.
    """
    from ..world import comm_or_world

    timeline = comm_or_world(comm).timeline
    started: List[float] = []

    def before(module, args):
        if timeline.on:
            started.append(time.perf_counter())

    def after(module, args, output):
        if started:
            timeline.add("forward", "torch", started.pop(), time.perf_counter(), {"module": type(module).__name__})

    return [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
