"""Waiting with a deadline on work whose backend blocks without one (Horovod's handles, MPI sends, a compressed
reduction): :func:`wait_until`, the one poll every such ``wait(timeout)`` uses."""
from __future__ import annotations

import time
from typing import Callable, Optional

__all__ = ["wait_until"]


def wait_until(test: Callable[[], bool], timeout: Optional[float], what: str = "the call") -> None:
    """Return once ``test()`` is true; :class:`TimeoutError` when ``timeout`` seconds pass first (None: return).

    For handles whose backend blocks without a deadline: polls ``test()``, the
    pause growing from 50 microseconds to 10 ms (a wait this long costs at
    most 10 ms more than the call).
    """
    if timeout is None:
        return
    deadline = time.monotonic() + timeout
    pause = 5e-5
    while not test():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} did not finish within {timeout} s (it is still in flight: wait again)")
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.01)
