"""Allocator settings for training loops: memory freed in one step is reused by the next without page faults.

A training step frees and allocates the same large blocks every step:
gradients after ``zero_grad(set_to_none=True)``, the output buffers of
backward kernels, activations and temporaries.  glibc's malloc serves a block
above its *mmap threshold* with a fresh mapping and unmaps it on free, and
gives the top of its heap back to the kernel once more than its *trim
threshold* is free; its thresholds also move with what the program frees.
Either way the next step writes to pages the kernel has to map and zero
again, one page fault per 4 KiB: for a model whose gradients alone take
tens of MiB that is thousands of faults per step, on the training thread
(PyTorch's CPU convolutions zero their weight gradient first, so the faults
land in backward).

:func:`keep_freed_memory` fixes both thresholds once per process
(``mallopt``): blocks up to 32 MiB, glibc's largest mmap threshold on 64-bit,
come from the heap, and the heap is trimmed only past 2 GiB free, so a
step reuses the pages of the step before.  Cost: the process keeps its
peak heap (what it freed stays resident, for the next step to use), as
with the jemalloc or tcmalloc that CPU-training guides preload for the
same reason.

It does nothing when the C library is not glibc, when the user set the
allocator already (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``,
``GLIBC_TUNABLES``, or ``LD_PRELOAD`` of another malloc), or when
``HPCTRAIN_KEEP_FREED_MEMORY=0``.  :func:`hpctrain.init` calls it.
"""
from __future__ import annotations

import ctypes
import os
from typing import Dict, Mapping, Optional

__all__ = ["keep_freed_memory", "environment", "MMAP_THRESHOLD_BYTES", "USER_SETTINGS"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20           # glibc refuses more (half its largest heap) on 64-bit
_TRIM_BYTES = (1 << 31) - 1               # (mallopt takes an int: the heap's top is trimmed past 2 GiB free)
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_applied: Optional[str] = None


def environment() -> Dict[str, str]:
    """The same thresholds as glibc environment variables, for a process that does not import hpctrain.

    A benchmark gives them to every peer, so that the peers it compares with
    hpctrain run on the same allocator settings.
    """
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES), "MALLOC_TRIM_THRESHOLD_": str(_TRIM_BYTES)}


def keep_freed_memory(env: Optional[Mapping[str, str]] = None) -> str:
    """Set glibc's mmap and trim thresholds for a training loop (module docstring); idempotent.

    Returns what was done, or why nothing was.
    """
    global _applied
    if _applied is not None:
        return _applied
    env = os.environ if env is None else env
    why = _leave_alone(env)
    if why:
        _applied = why
        return why
    libc = _glibc()
    if libc is None:
        _applied = "left as is: the C library is not glibc"
    elif not (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES)):
        _applied = "left as is: glibc refused mallopt"
    else:
        _applied = f"glibc malloc: blocks up to {MMAP_THRESHOLD_BYTES >> 20} MiB from the heap, freed memory kept"
    return _applied


def _leave_alone(env: Mapping[str, str]) -> str:
    from . import settings

    if not settings.get("HPCTRAIN_KEEP_FREED_MEMORY", env):
        return "left as is: HPCTRAIN_KEEP_FREED_MEMORY=0"
    chosen = [name for name in USER_SETTINGS if env.get(name)]
    if chosen:
        return f"left as is: {', '.join(chosen)} set by the user"
    preload = env.get("LD_PRELOAD", "")
    if "malloc" in preload or "jemalloc" in preload:
        return f"left as is: another allocator is preloaded ({preload})"
    return ""


def _glibc():
    try:
        libc = ctypes.CDLL(None)                   # the symbols the process has loaded: its C library's
        libc.gnu_get_libc_version                  # (only glibc has it)
        libc.mallopt
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return libc
