"""See what a run does: per-step metrics with stragglers and resource use (steps.py), their files (sinks.py), plots (report.py)."""
from .resources import ResourceSampler
from .steps import StepMetrics

__all__ = ["ResourceSampler", "StepMetrics"]
