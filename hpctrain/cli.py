"""The ``hpctrain`` command: ``launch`` ranks, print ``info``."""
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


def main(argv=None) -> int:
    """Run the hpctrain command line and return its exit status."""
    parser = argparse.ArgumentParser(prog="hpctrain", description="hpctrain: distributed training tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="start N ranks of a program with mpirun (or srun in Slurm)")
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("program", nargs=argparse.REMAINDER, help="script.py args..., or a command")
    p.set_defaults(func=_launch)
    p = sub.add_parser("info", help="versions, launcher, rank layout and working backends")
    p.set_defaults(func=_info)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
