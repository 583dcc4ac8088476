"""The ``hpctrain`` command: ``launch`` ranks, print ``info``, ``check`` what works, ``tune`` the thresholds."""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _launch(args) -> int:
    from .launch import build_command

    argv = args.program[1:] if args.program[:1] == ["--"] else args.program
    cmd = build_command(args.n, argv)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached


def _info(args) -> int:
    from .info import report

    text = report()
    if text:
        print(text)
    return 0


def _check(args) -> int:
    from .check import run_checks

    print(f"hpctrain check: a small all-reduce on each backend and framework (timeout {args.timeout:g} s each)",
          flush=True)
    outcomes = run_checks(args.only, args.timeout)
    for outcome in outcomes:
        print(outcome.line(), flush=True)
    return 0 if all(o.works for o in outcomes) else 1


def _tune(args) -> int:
    from .tune import run_tune

    data = run_tune(args.n, args.out, args.rounds)
    for name, value in data["thresholds"].items():
        print(f"{name} = {value} bytes")
    print(f"written to {data['path']} (read by hpctrain.init(); HPCTRAIN_* environment variables still win)")
    return 0


def main(argv=None) -> int:
    """Run the hpctrain command line and return its exit status."""
    parser = argparse.ArgumentParser(prog="hpctrain", description="hpctrain: distributed training tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="start N ranks of a program with mpirun (or srun in Slurm)")
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("program", nargs=argparse.REMAINDER, help="script.py args..., or a command")
    p.set_defaults(func=_launch)
    p = sub.add_parser("info", help="versions, launcher, rank layout and importable backends")
    p.set_defaults(func=_info)
    p = sub.add_parser("check", help="run a 2-rank all-reduce on each backend and framework; say what works")
    p.add_argument("--only", nargs="+", metavar="NAME", help="these checks only (local, mpi, horovod, torch, "
                   "tensorflow)")
    p.add_argument("--timeout", type=float, default=120, help="seconds each check may take (default 120)")
    p.set_defaults(func=_check)
    p = sub.add_parser("tune", help="measure the all-reduce thresholds of this machine and save them")
    p.add_argument("-n", "--np", dest="n", type=int, default=2, help="number of ranks (default 2)")
    p.add_argument("--out", default="",
                   help="file to write (default: HPCTRAIN_TUNE_FILE or ~/.config/hpctrain/tune.json)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per size (default 3)")
    p.set_defaults(func=_tune)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
