"""Checkpoint and stop on all ranks when any rank receives a preemption signal."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Iterable, Optional

from .. import settings
from .manager import EXIT_PREEMPTED, CheckpointManager

__all__ = ["on_preemption"]

log = logging.getLogger("hpctrain")


def on_preemption(manager: CheckpointManager, signals: Iterable[int] = (signal.SIGUSR2, signal.SIGTERM),
                  requeue: Optional[bool] = None, exit: bool = True) -> None:
    """Make ``signals`` on any rank end the job cleanly with a checkpoint at the next step boundary.

    The handler only records the signal.  At the next ``manager.save(step, state)``
    (call it every step) the ranks all-reduce a flag, so every rank learns of a
    signal that reached any one of them at the same step; they save that step
    synchronously, commit it, and then:

    * with ``requeue`` and under Slurm (``SLURM_JOB_ID`` set), rank 0 runs
      ``scontrol requeue $SLURM_JOB_ID`` so the job comes back by itself
      (default: on when ``HPCTRAIN_REQUEUE=1``, which ``slurm/preemptible.sbatch`` sets);
    * with ``exit`` (default) every rank exits with status
      :data:`~hpctrain.checkpoint.EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: run again
      to resume); otherwise ``manager.preempted`` becomes True and the training
      loop decides.

    Slurm sends SIGTERM to every task at preemption and SIGKILL ``KillWait``
    seconds later (30 s by default): a step plus a save must fit in that time.
    ``sbatch --signal=USR2@<seconds>`` warns earlier (``B:`` sends it to the
    batch shell only, which must then forward it).  Must be called from the main
    thread, on every rank.  Cost: one 3-integer all-reduce per ``save()`` call.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("on_preemption must be called from the main thread (Python delivers signals there)")
    if requeue is None:
        requeue = settings.get("HPCTRAIN_REQUEUE")
    signals = tuple(signals)
    if not signals:
        raise ValueError("on_preemption needs at least one signal")

    received = {}

    def handler(signum, frame):
        if manager.signal_received is None:
            manager.signal_received = received["signal"] = signum

    for sig in signals:
        signal.signal(sig, handler)
    manager.preemption_armed = True

    def stop(mgr: CheckpointManager) -> None:
        step = mgr.latest_step()
        if mgr.comm.rank == 0:
            got = received.get("signal")
            name = signal.Signals(got).name if got else "a signal on another rank"
            print(f"hpctrain: preempted ({name}); checkpoint of step {step} committed ({mgr.directory}): run the "
                  f"same command again to resume", file=sys.stderr, flush=True)
            job = os.environ.get("SLURM_JOB_ID")
            if requeue and job:
                res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
                if res.returncode != 0:
                    log.warning("hpctrain: scontrol requeue %s failed: %s", job, res.stderr.strip())
                else:
                    print(f"hpctrain: requeued Slurm job {job}", file=sys.stderr, flush=True)
        mgr.comm.barrier()
        if exit:
            mgr.close()
            raise SystemExit(EXIT_PREEMPTED)

    manager.on_preempted = stop
