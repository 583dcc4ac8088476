"""Copy many arrays into host buffers with several threads: the snapshot step of an asynchronous save."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["HostCopier", "default_copy_threads"]

MIN_CHUNK = 4 << 20     # bytes: below this a thread hand-off costs more than it saves


def default_copy_threads(local_size: int) -> int:
    """This rank's share of the cores it may run on, between 1 and 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:      # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // max(1, local_size)))


class HostCopier:
    """Run ``dst[...] = src`` for a list of pairs, split in byte ranges over ``threads`` threads.

    One thread copying reaches only part of a socket's memory bandwidth; the
    snapshot of an asynchronous save blocks training, so it uses the cores
    this rank owns (they are idle at a step boundary).  Pairs whose source is
    not C-contiguous are copied whole by one thread.  numpy releases the GIL
    while copying, so the threads run in parallel.  Cost: ``bytes / (threads
    x per-thread copy bandwidth)``, bounded by the memory bandwidth.
    """

    def __init__(self, threads: int):
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"copy threads must be a positive int, got {threads!r}")
        self.threads = threads
        self._pool: Optional[ThreadPoolExecutor] = None

    def copy(self, pairs: Sequence[Tuple[np.ndarray, np.ndarray]]) -> None:
        """Copy every ``src`` into its ``dst`` (same shape and dtype; ``dst`` C-contiguous); return when done."""
        total = sum(dst.nbytes for dst, _ in pairs)
        if self.threads == 1 or total < 2 * MIN_CHUNK:
            for dst, src in pairs:
                np.copyto(dst, src)
            return
        chunk = max(MIN_CHUNK, -(-total // self.threads))
        jobs: List[Tuple[np.ndarray, np.ndarray]] = []
        for dst, src in pairs:
            if not src.flags.c_contiguous or dst.nbytes <= chunk:
                jobs.append((dst, src))
                continue
            d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
            for start in range(0, d.size, chunk):
                jobs.append((d[start:start + chunk], s[start:start + chunk]))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hpctrain-copy")
        # deal the jobs round-robin to the threads; this thread takes share 0
        shares = [jobs[i::self.threads] for i in range(self.threads)]
        futures = [self._pool.submit(_copy_all, share) for share in shares[1:] if share]
        _copy_all(shares[0])
        for f in futures:
            f.result()

    def close(self) -> None:
        """Stop the threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _copy_all(jobs: Sequence[Tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in jobs:
        np.copyto(dst, src)
