"""Hybrid parallelism: process layouts and pipeline schedules (framework-agnostic).

:class:`ParallelLayout` gives each rank its data/pipeline/tensor-parallel
coordinates and the sub-communicator of each axis; :mod:`.schedule` gives the
pipeline schedules as lists of actions, which :class:`hpctrain.torch.Pipeline`
and :class:`hpctrain.tensorflow.Pipeline` run, sending activations through
:class:`.links.StageLinks` (shapes exchanged once).  No module-level state: pass the layout where it is needed.
"""
from .layout import AXES, ParallelLayout
from .links import PipelineError, StageLinks
from .schedule import SCHEDULES, Action, bubble_fraction, gpipe, one_f_one_b, schedule

__all__ = ["ParallelLayout", "AXES", "Action", "gpipe", "one_f_one_b", "SCHEDULES", "schedule",
           "bubble_fraction", "PipelineError", "StageLinks"]
