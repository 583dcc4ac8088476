"""What the communication log and the timeline share: a per-rank record switched on and off at run time."""
from __future__ import annotations

import threading

__all__ = ["Recorder"]


class Recorder:
    """Records while ``on``; ``clear()`` forgets under the lock (subclasses say what in ``_forget``)."""

    def __init__(self, on: bool = False):
        self.on = on
        self._lock = threading.Lock()

    def start(self) -> None:
        """Record from now on."""
        self.on = True

    def stop(self) -> None:
        """Stop recording (what was recorded stays)."""
        self.on = False

    def clear(self) -> None:
        """Forget what was recorded."""
        with self._lock:
            self._forget()

    def _forget(self) -> None:
        raise NotImplementedError
