"""``hpctrain.horovod.run``: run a Python function on N ranks and return every rank's result, as ``horovod.run``.

The function and its arguments are pickled with cloudpickle into a private
temporary folder, ranks start with ``hpctrain launch`` (mpirun, srun inside
Slurm, or ``horovodrun --gloo`` with ``use_gloo=True``), each rank runs
``python -m hpctrain.horovod.runner FOLDER``, calls the function and writes
its return value next to it; the caller reads them back in rank order.  The
pickles are this process's own files in a folder only it and its ranks use
(a run's inputs and outputs, never a checkpoint).  A rank that raises ends
the job (see :mod:`hpctrain.run`) and ``run`` raises RuntimeError with the
output's tail.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, List, Optional

__all__ = ["run"]


def run(func: Callable[..., Any], args=(), kwargs=None, np: int = 1, hosts: Optional[str] = None,
        hostfile: Optional[str] = None, start_timeout: Optional[float] = None, verbose: Optional[bool] = None,
        use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None, executable: Optional[str] = None,
        min_np=None, max_np=None, **unsupported) -> List[Any]:
    """Run ``func(*args, **kwargs)`` on ``np`` ranks and return the list of their results (rank order).

    Takes horovod.run's common arguments; elastic ones (``min_np``,
    ``max_np``) and ssh/network options are refused with a ValueError.
    """
    import cloudpickle

    from ..launcher.launch import build_command

    if min_np is not None or max_np is not None:
        raise ValueError("elastic runs (min_np/max_np) are not built in hpctrain yet; pass np only")
    if unsupported:
        raise ValueError(f"hpctrain.horovod.run does not take {sorted(unsupported)}; hosts, hostfile, np, "
                         f"use_gloo/use_mpi, start_timeout, verbose and executable are supported")
    if use_gloo and use_mpi:
        raise ValueError("choose use_gloo or use_mpi, not both")
    with tempfile.TemporaryDirectory(prefix="hpctrain-run-") as folder:
        with open(os.path.join(folder, "func.pkl"), "wb") as f:
            cloudpickle.dump((func, tuple(args), dict(kwargs or {})), f)
        python = executable or sys.executable
        cmd = build_command(int(np), [python, "-m", "hpctrain.horovod.runner", folder], hosts=hosts,
                            hostfile=hostfile, gloo=bool(use_gloo), start_timeout=start_timeout)
        if verbose:
            print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)     # the ranks' output goes to ours
        sys.stderr.write(proc.stderr or "")
        if proc.returncode != 0:
            tail = (proc.stderr or "")[-4000:]
            raise RuntimeError(f"hpctrain.horovod.run: the ranks ended with exit status {proc.returncode}:\n{tail}")
        results = []
        for rank in range(int(np)):
            path = os.path.join(folder, f"result-{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"hpctrain.horovod.run: rank {rank} returned no result")
            with open(path, "rb") as f:
                results.append(cloudpickle.load(f))
        return results


def _main(folder: str) -> None:
    import cloudpickle

    from ..env import detect_launcher

    with open(os.path.join(folder, "func.pkl"), "rb") as f:
        func, args, kwargs = cloudpickle.load(f)
    launch = detect_launcher()
    rank = launch.rank if launch is not None else 0
    value = func(*args, **kwargs)
    tmp = os.path.join(folder, f".result-{rank}.pkl")
    with open(tmp, "wb") as f:
        cloudpickle.dump(value, f)
    os.replace(tmp, os.path.join(folder, f"result-{rank}.pkl"))


if __name__ == "__main__":
    _main(sys.argv[1])
