"""How long a host where a rank failed is left out of the elastic job (``--blacklist-cooldown-range MIN MAX``).

Without a range a host is left out until the discovery script stops listing
it and lists it again (with fixed hosts, ``-H``/``--hostfile``: for good).  With
one, the ``k``-th time a host is left out it is offered again after

    cooldown(k) = min(MAX, MIN * 2**(k - 1))  seconds

(MIN, 2 MIN, 4 MIN, ... up to MAX), so a host that keeps failing costs fewer
restarts.  horovodrun's range means the same, with a random part added to
each cooldown; here it is exact, so that a run can be followed.  Cost: one
dictionary look-up per host per poll of the launcher.
"""
from __future__ import annotations

import time
from typing import Dict, Iterable, Optional, Set, Tuple

__all__ = ["Cooldown", "check_range"]


def check_range(bounds: Optional[Tuple[int, int]]) -> None:
    """Raise ValueError (one line) for a range that is not ``0 <= MIN <= MAX``."""
    if bounds is None:
        return
    low, high = bounds
    if not 0 <= low <= high:
        raise ValueError(f"--blacklist-cooldown-range takes MIN MAX seconds with 0 <= MIN <= MAX, got {low} {high}")


class Cooldown:
    """The hosts left out after a failure and when each is offered again (module docstring)."""

    def __init__(self, bounds: Optional[Tuple[int, int]] = None, clock=time.monotonic):
        check_range(bounds)
        self.bounds, self.clock = bounds, clock
        self.times: Dict[str, int] = {}       # how often each host was left out
        self.until: Dict[str, float] = {}     # hosts left out now -> when they come back (inf: not by time)

    def leave_out(self, hosts: Iterable[str]) -> None:
        """Leave ``hosts`` out from now (a host already out keeps its cooldown)."""
        now = self.clock()
        for host in hosts:
            if self.until.get(host, -1.0) > now:
                continue
            self.times[host] = self.times.get(host, 0) + 1
            if self.bounds is None:
                self.until[host] = float("inf")
            else:
                low, high = self.bounds
                self.until[host] = now + min(high, low * 2 ** (self.times[host] - 1))

    def forgive(self, hosts: Iterable[str]) -> None:
        """Offer ``hosts`` again now (the discovery script dropped them: one that comes back is a new host)."""
        for host in hosts:
            self.until.pop(host, None)

    def left_out(self) -> Set[str]:
        """The hosts left out now (those whose cooldown ended are offered again)."""
        now = self.clock()
        for host in [h for h, t in self.until.items() if t <= now]:
            del self.until[host]
        return set(self.until)
