"""See what a run does: per-step metrics with stragglers and resource use (steps.py), their files (sinks.py),
plots (report.py); the timeline (recorded by the communicator: :mod:`hpctrain.comm.recording.timeline`)."""
from ..comm.recording.timeline import Timeline, write_trace
from .resources import ResourceSampler
from .steps import StepMetrics

__all__ = ["ResourceSampler", "StepMetrics", "Timeline", "write_trace"]
