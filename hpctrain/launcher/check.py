"""``hpctrain check``: run a small all-reduce on every backend and framework and say which ones work.

``hpctrain info`` only imports things; this runs them, as a user's job would:
each check is a separate program started the way ``hpctrain launch`` starts
one (mpirun, or srun inside an allocation) on 2 ranks (the local backend on
1), with a timeout, and it works only if every rank gets the right result.
A check that fails reports the reason: the last lines the program printed, or
that it timed out.  Cost: one launch per check (seconds each; TensorFlow's
import dominates its check).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .launch import build_command

__all__ = ["CHECKS", "Check", "Outcome", "run_check", "run_checks"]

_SUM = "assert float(y[0]) == n * (n + 1) / 2, (y, n)"


@dataclass(frozen=True)
class Check:
    """One thing to try: a name, the ranks to run it on, the backend it forces, and its program."""

    name: str
    ranks: int
    backend: str
    code: str


CHECKS = (
    Check("local", 1, "local", "import hpctrain, numpy as np; c = hpctrain.init('local'); "
          "y = c.allreduce(np.ones(4)); assert float(y[0]) == 1.0, y"),
    Check("mpi", 2, "mpi", "import hpctrain, numpy as np; c = hpctrain.init('mpi'); n = c.size; "
          f"y = c.allreduce(np.full(4, c.rank + 1.0)); {_SUM}"),
    Check("horovod", 2, "horovod", "import hpctrain, numpy as np; c = hpctrain.init('horovod'); n = c.size; "
          f"y = c.allreduce(np.full(4, c.rank + 1.0)); {_SUM}"),
    Check("torch", 2, "mpi", "import torch, hpctrain, hpctrain.torch as ht; c = hpctrain.init(); n = c.size; "
          "y = ht.allreduce(torch.full((4,), c.rank + 1.0), op='sum'); " + _SUM + "; "
          "m = torch.nn.Linear(3, 1); o = ht.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)); "
          "m(torch.ones(2, 3)).sum().backward(); o.step()"),
    Check("tensorflow", 2, "mpi", "import tensorflow as tf, hpctrain, hpctrain.tensorflow as htf; "
          "c = hpctrain.init(); n = c.size; y = htf.allreduce(tf.fill([4], c.rank + 1.0), op='sum').numpy(); "
          + _SUM),
)


@dataclass(frozen=True)
class Outcome:
    """What one check did: whether it works, how long it took, and why it failed."""

    check: Check
    works: bool
    seconds: float
    reason: str = ""

    def line(self) -> str:
        """The check as one line of the report."""
        where = f"{self.check.ranks} rank{'s' if self.check.ranks > 1 else ''}"
        if self.works:
            return f"  {self.check.name:<11} works ({where}, {self.seconds:.1f} s)"
        return f"  {self.check.name:<11} fails ({where}): {self.reason}"


def run_check(check: Check, timeout: float) -> Outcome:
    """Launch ``check`` and wait at most ``timeout`` seconds for it."""
    env = dict(os.environ, HPCTRAIN_BACKEND=check.backend, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    if check.ranks == 1:
        cmd = [sys.executable, "-c", check.code]
    else:
        cmd = build_command(check.ranks, [sys.executable, "-c", check.code], env=env)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return Outcome(check, False, time.monotonic() - start, f"no result within {timeout:g} s")
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return Outcome(check, True, seconds)
    return Outcome(check, False, seconds, f"exit status {proc.returncode}: {_last_lines(out)}")


def _last_lines(text: str, count: int = 3) -> str:
    """The reason in a failed program's output: its last Python error line, else its last lines."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not set(ln.strip()) <= {"-"}]
    errors = [ln for ln in lines if re.match(r"^(\[[^\]]*\]\s*)?([\w.]*(Error|Exception)\b.*: |hpctrain: error: )", ln)]
    if errors:
        return errors[-1]
    return " | ".join(lines[-count:]) or "(no output)"


def run_checks(names: Optional[Sequence[str]] = None, timeout: float = 120) -> List[Outcome]:
    """Run the checks named (default: all of :data:`CHECKS`) one after another."""
    known = {c.name: c for c in CHECKS}
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return [run_check(known[n], timeout) for n in (names or known)]
