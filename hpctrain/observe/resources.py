"""Sample what one rank uses: CPU, memory, network and (where there is one) GPU, through psutil and torch.cuda."""
from __future__ import annotations

import math
import sys
import time
from typing import Dict

__all__ = ["FIELDS", "ResourceSampler"]

# What one sample holds; NaN where this machine cannot say (no GPU, or no NVML for its utilisation).
FIELDS = ("cpu_percent", "rss_bytes", "net_sent_bytes_per_s", "net_recv_bytes_per_s",
          "gpu_util_percent", "gpu_memory_bytes")


class ResourceSampler:
    """Per-rank resource use between two calls of :meth:`sample`.

    * ``cpu_percent``: this process's CPU time over the interval, as psutil
      counts it (100 = one core busy, so up to 100 x cores);
    * ``rss_bytes``: its resident memory now;
    * ``net_*_bytes_per_s``: bytes through every interface of the node (or
      network namespace) per second over the interval: ranks on one node see
      the same traffic;
    * ``gpu_*``: only where torch was imported by the program and sees a
      GPU: ``torch.cuda.utilization()`` (needs NVML) and
      ``torch.cuda.memory_allocated()`` of the current device.

    Cost: a few system calls per sample; nothing runs between samples.
    """

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)            # starts the first interval
        self._net = psutil.net_io_counters()
        self._t = time.monotonic()

    def sample(self) -> Dict[str, float]:
        """Return the use since the previous sample (the first: since construction), as a dict of FIELDS."""
        now = time.monotonic()
        dt = max(now - self._t, 1e-9)
        net = self._psutil.net_io_counters()
        out = {
            "cpu_percent": float(self._proc.cpu_percent(None)),
            "rss_bytes": float(self._proc.memory_info().rss),
            "net_sent_bytes_per_s": (net.bytes_sent - self._net.bytes_sent) / dt,
            "net_recv_bytes_per_s": (net.bytes_recv - self._net.bytes_recv) / dt,
        }
        self._net, self._t = net, now
        out.update(_gpu())
        return out


def _gpu() -> Dict[str, float]:
    """GPU utilisation and allocated memory of the current CUDA device, NaN without one (torch never imported here)."""
    out = {"gpu_util_percent": math.nan, "gpu_memory_bytes": math.nan}
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return out
    out["gpu_memory_bytes"] = float(torch.cuda.memory_allocated())
    try:
        out["gpu_util_percent"] = float(torch.cuda.utilization())
    except Exception:       # no NVML (pynvml) on this machine: memory only
        pass
    return out
