"""Where rank 0 writes per-step metrics: CSV, JSON lines and TensorBoard event files in one run folder.

Layout of a run folder (what ``hpctrain report`` reads)::

    steps.csv / steps.jsonl   one row per step, over all ranks (see StepMetrics)
    ranks.jsonl               one row per rank and window of steps: its times and resource use
    stragglers.jsonl          one row per straggler warning
    tensorboard/              event files (tensorboard --logdir RUN_FOLDER/tensorboard)
"""
from __future__ import annotations

import csv
import json
import math
import os
import socket
import time
from typing import Dict, List, Optional

__all__ = ["RunWriter"]


def _clean(row: Dict) -> Dict:
    """JSON has no NaN: write null instead."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def _event_file(folder: str):
    """Open a new TensorBoard event file in ``folder`` (TFRecord framing by tensorboard's RecordWriter).

    tensorboard's EventFileWriter would import TensorFlow (seconds, and memory)
    wherever it is installed, for its file layer; a plain file does the same.
    """
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as exc:
        raise ImportError(f"TensorBoard event files need the tensorboard package ({exc}): pip install tensorboard, "
                          f"or pass tensorboard=False") from exc

    os.makedirs(folder, exist_ok=True)
    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
    writer = RecordWriter(open(os.path.join(folder, name), "wb"))
    writer.write(Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
    return writer


class RunWriter:
    """Rank 0's writer of one run folder (see the module docstring); ``tensorboard=False`` leaves the event files out."""

    def __init__(self, folder: str, tensorboard: bool = True):
        os.makedirs(folder, exist_ok=True)
        self.folder = folder
        self._csv_file = None
        self._csv = None
        self._steps = open(os.path.join(folder, "steps.jsonl"), "a")
        self._ranks = open(os.path.join(folder, "ranks.jsonl"), "a")
        self._stragglers: Optional[object] = None
        self._tb = None
        if tensorboard:
            self._tb = _event_file(os.path.join(folder, "tensorboard"))

    def step(self, row: Dict) -> None:
        """Write one step's row (the same keys every time) to steps.csv, steps.jsonl and TensorBoard (``steps/<name>``)."""
        if self._csv is None:
            path = os.path.join(self.folder, "steps.csv")
            fresh = not os.path.exists(path) or os.path.getsize(path) == 0
            self._csv_file = open(path, "a", newline="")
            self._csv = csv.DictWriter(self._csv_file, fieldnames=list(row))
            if fresh:
                self._csv.writeheader()
        self._csv.writerow(row)
        self._steps.write(json.dumps(_clean(row)) + "\n")
        self.scalars(row["step"], {f"steps/{k}": v for k, v in row.items() if k not in ("step", "time")})

    def ranks(self, rows: List[Dict]) -> None:
        """Write one window's per-rank rows to ranks.jsonl and TensorBoard (as ``ranks/<name>/rank<r>``)."""
        for row in rows:
            self._ranks.write(json.dumps(_clean(row)) + "\n")
            self.scalars(row["step_last"], {f"ranks/{k}/rank{row['rank']}": v for k, v in row.items()
                                            if k not in ("rank", "step_first", "step_last")})

    def straggler(self, event: Dict) -> None:
        """Write a straggler warning to stragglers.jsonl."""
        if self._stragglers is None:
            self._stragglers = open(os.path.join(self.folder, "stragglers.jsonl"), "a")
        self._stragglers.write(json.dumps(_clean(event)) + "\n")

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        """Add scalars at ``step`` to the TensorBoard event file (NaN and non-numbers are left out)."""
        if self._tb is None:
            return
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()
                  if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))]
        if values:
            self._tb.write(Event(wall_time=time.time(), step=int(step), summary=Summary(value=values)).SerializeToString())

    def flush(self) -> None:
        """Push everything written so far to disk."""
        for f in (self._csv_file, self._steps, self._ranks, self._stragglers):
            if f is not None:
                f.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close every file."""
        self.flush()
        for f in (self._csv_file, self._steps, self._ranks, self._stragglers):
            if f is not None:
                f.close()
        if self._tb is not None:
            self._tb.close()
