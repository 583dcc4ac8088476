"""Which of hpctrain's shared-memory algorithm and the library's call runs a mid-size collective: measured here.

Whether hpctrain's one-node shared-memory pass beats the MPI library's own
call depends on the machine, not on anything a formula of bytes and ranks
knows: on a 2-core VM, where the library's busy polls fight over the cores,
the shared-memory pass is several times faster from 16 KiB on; on a node
with 16 free cores the library (single-copy shared memory) wins at 2 ranks up
to 16 MiB and at 16 ranks up to 4 MiB.  So with HPCTRAIN_SHM_MIN_BYTES at
its default (0), ``auto`` measures instead of guessing.

Sizes are grouped in classes of powers of four (``(4**(k-1), 4**k]``
bytes).  The first call of a class above HPCTRAIN_SHM_SMALL_BYTES (below it
the small calls ride the call check) and up to 64 MiB (above it hpctrain's
way always runs: see ``MEASURED_MAX_BYTES``) first runs ``2 * (TRIALS + 1)`` probes
on a scratch buffer of its size, alternating the two ways: own, library,
own, library, ...; the first pair warms both up (windows, first touch) and
is not counted.  Then every rank contributes its times to one library
all-reduce (max: the slowest rank decides how long a collective takes),
and all ranks keep the library only where its median time is under 0.9x
hpctrain's (near-equal ways are noise: hpctrain's way, whose bits do not
depend on the library, stays).  The
probes run in the collective lane inside the call, so every rank probes at
the same call and decides alike; the caller's data only ever goes the
decided way, so a repeated call gives the same bits every time within a
run.  (Across runs the choice may differ where the two ways are close:
name the algorithm, or set HPCTRAIN_SHM_MIN_BYTES, for bit-reproducible
runs.)

Cost: once per class and communicator, ``2 * (TRIALS + 1)`` extra calls of
that size and one 10-float all-reduce; nothing afterwards (one dict lookup
per call).  A set HPCTRAIN_SHM_MIN_BYTES, or a tuning file from
``hpctrain tune``, pins the threshold instead and nothing is measured.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import numpy as np

__all__ = ["MeasuredChoice", "size_class", "TRIALS", "SWITCH_BELOW", "MEASURED_MAX_BYTES", "OWN", "LIBRARY"]

TRIALS = 5
OWN, LIBRARY = "shm", "native"      # the two ways, as the algorithms are named
# the library must be this much faster (median time under this fraction of hpctrain's) to be chosen: a
# choice between near-equal ways is left to hpctrain's, whose results are the same bits run after run
SWITCH_BELOW = 0.9
# Above this, nothing is measured and hpctrain's way runs: on every machine measured so far it wins there (a
# 16-core node: 1.5-1.9x MPI_Allreduce's bus bandwidth at 64 MiB, 2-16 ranks), and a probe would need a
# scratch buffer as large as the call's.
MEASURED_MAX_BYTES = 64 << 20
T = TypeVar("T")


def size_class(nbytes: int) -> int:
    """Return k for ``4**(k-1) < nbytes <= 4**k`` (the class a measured choice is kept for)."""
    return ((max(int(nbytes), 1) - 1).bit_length() + 1) // 2


class MeasuredChoice:
    """Run each mid-size collective the way measured faster on this communicator (see the module docstring).

    Args:
        agree_max: ``agree_max(float64 array) -> elementwise max over the ranks``; runs inside the
            collective being performed (a library call, not a checked collective).
        min_bytes: calls of more than this many bytes are measured (HPCTRAIN_SHM_SMALL_BYTES).
        clock: the timer (``time.perf_counter``).
    """

    def __init__(self, agree_max: Callable[[np.ndarray], np.ndarray], min_bytes: int,
                 clock: Callable[[], float] = time.perf_counter):
        self._agree = agree_max
        self.min_bytes = int(min_bytes)
        self._clock = clock
        self.decided: Dict[Tuple[str, int], bool] = {}     # (collective, class) -> hpctrain's way is faster

    def applies(self, nbytes: int) -> bool:
        """Return True if a call of ``nbytes`` bytes is run the measured way (above ``min_bytes``, up to
        MEASURED_MAX_BYTES)."""
        return self.min_bytes < nbytes <= MEASURED_MAX_BYTES

    def own_is_faster(self, collective: str, nbytes: int) -> Optional[bool]:
        """Return the decision for ``collective`` at ``nbytes`` (None: not measured yet)."""
        return self.decided.get((collective, size_class(nbytes)))

    def run(self, collective: str, nbytes: int, way: Callable[[str], T],
            probe: Callable[[np.ndarray, str], object], like: Tuple[tuple, Any]) -> T:
        """Return ``way(OWN)`` or ``way(LIBRARY)`` (the caller's data), as decided for this size class.

        The first call of a class decides it first: ``probe(scratch, OWN)``
        against ``probe(scratch, LIBRARY)`` on one array of zeros of ``like``
        (shape, dtype), dropped afterwards.
        """
        key = (collective, size_class(nbytes))
        decided = self.decided.get(key)
        if decided is None:
            decided = self.decided[key] = self._measure(probe, np.zeros(*like))
        return way(OWN if decided else LIBRARY)

    def _measure(self, probe: Callable[[np.ndarray, str], object], scratch: np.ndarray) -> bool:
        times: Dict[bool, List[float]] = {True: [], False: []}
        for i in range(2 * (TRIALS + 1)):
            mine = i % 2 == 0
            t0 = self._clock()
            probe(scratch, OWN if mine else LIBRARY)
            if i >= 2:                              # the first pair warms both ways up
                times[mine].append(self._clock() - t0)
        agreed = self._agree(np.array(times[True] + times[False], dtype=np.float64))
        return not statistics.median(agreed[TRIALS:]) < SWITCH_BELOW * statistics.median(agreed[:TRIALS])
