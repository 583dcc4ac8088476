"""The ``hpctrain`` command: ``launch`` ranks, print ``info``, ``check`` what works, ``tune`` the thresholds, ``report`` a run."""
from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _launch(args) -> int:
    from .. import settings
    from .launch import build_command, remove_stale_session_dirs

    if args.gloo and args.mpi:
        print("hpctrain launch: choose --gloo or --mpi, not both", file=sys.stderr)
        return 2
    argv = args.program[1:] if args.program[:1] == ["--"] else args.program
    if args.start_timeout is not None and not args.gloo:
        print("hpctrain launch: --start-timeout applies to --gloo launches (horovodrun's); mpirun and srun "
              "use their own start-up timeouts", file=sys.stderr)
    _check_elastic_flags(args)
    if args.host_discovery_script:
        return _launch_discovered(args, argv)
    hosts = _fixed_hosts(args) if args.elastic else None
    n = _elastic_size(args, hosts) if args.elastic else args.n
    if n is None:
        print("hpctrain launch: give the number of ranks, -n N", file=sys.stderr)
        return 2
    cmd = build_command(n, argv, hosts=args.hosts, hostfile=args.hostfile, gloo=args.gloo,
                        start_timeout=args.start_timeout, elastic=args.elastic, min_np=args.min_np,
                        exports=_reset_limit(args))
    _check_before_launch(argv)
    if args.dry_run or args.verbose:
        print(" ".join(cmd), flush=True)
    if args.dry_run:
        return 0
    settings.mark_launch_checked()      # the ranks' init() need not warn again
    sys.stdout.flush()
    if not args.gloo:
        remove_stale_session_dirs(pid=os.getpid())   # mpirun gets this pid: a killed one's folder stops it
    if args.elastic:
        from .elastic_driver import run_fixed_hosts, run_with_discovery
        from .elastic_run import run_elastic

        if hosts is None:           # (one host: no remote daemon to lose)
            return run_elastic(cmd)
        if args.cooldown_range:     # (horovodrun's blacklisting: a host left out comes back after its cooldown)
            from .cooldown import Cooldown

            return run_with_discovery(argv, lambda: list(hosts), args.min_np or 1, n, build_command, run_elastic,
                                      exports=_reset_limit(args), cooldown=Cooldown(tuple(args.cooldown_range)))
        return run_fixed_hosts(n, argv, hosts, args.min_np or 1, build_command, run_elastic,
                               exports=_reset_limit(args))
    if os.path.basename(cmd[0]) in ("srun", "horovodrun"):
        os.execv(cmd[0], cmd)       # (they handle Ctrl-C themselves)
    from .launch import run_forwarding_signals

    return run_forwarding_signals(cmd)


def _check_elastic_flags(args) -> None:
    """Refuse (ValueError, one line) an elastic flag without --elastic or with values that do not fit together;
    apply ``--elastic-timeout`` (HPCTRAIN_ELASTIC_TIMEOUT_S, read by this launcher)."""
    from .. import settings
    from .cooldown import check_range

    given = [flag for flag, value in (("--reset-limit", args.reset_limit), ("--max-np", args.max_np),
                                      ("--elastic-timeout", args.elastic_timeout),
                                      ("--blacklist-cooldown-range", args.cooldown_range),
                                      ("--host-discovery-script", args.host_discovery_script))
             if value is not None]
    if given and not args.elastic:
        raise ValueError(f"{given[0]} goes with --elastic")
    if args.max_np is not None and args.max_np < 1:
        raise ValueError(f"--max-np must be 1 or more, got {args.max_np}")
    if args.max_np is not None and args.min_np is not None and args.max_np < args.min_np:
        raise ValueError(f"--max-np ({args.max_np}) is below --min-np ({args.min_np})")
    check_range(args.cooldown_range)
    if args.cooldown_range and not (args.hosts or args.hostfile or args.host_discovery_script):
        raise ValueError("--blacklist-cooldown-range needs hosts to leave out and take back: give -H, --hostfile "
                         "or --host-discovery-script (on one host a failed rank's world re-forms in place)")
    if args.elastic_timeout is not None:
        if args.elastic_timeout <= 0:
            raise ValueError(f"--elastic-timeout must be more than 0 seconds, got {args.elastic_timeout}")
        os.environ[settings.setting("HPCTRAIN_ELASTIC_TIMEOUT_S").name] = str(args.elastic_timeout)


def _elastic_size(args, hosts):
    """The ranks an elastic launch on fixed hosts starts (None: -n missing).

    As horovodrun: with ``--max-np`` every slot of ``-H``/``--hostfile`` up to
    ``--max-np`` (at least ``-n``); without it, ``-n`` ranks (horovodrun would
    fill every slot).  On this host alone ``--max-np`` only caps ``-n``.
    """
    if args.max_np is None or hosts is None:
        if args.n is not None and args.max_np is not None and args.max_np < args.n:
            raise ValueError(f"--max-np ({args.max_np}) is below -np ({args.n})")
        return args.n
    slots = sum(s for _, s in hosts)
    if args.n is not None and args.n > min(slots, args.max_np):
        raise ValueError(f"-np ({args.n}) is more than the {min(slots, args.max_np)} rank(s) the hosts' {slots} "
                         f"slot(s) and --max-np {args.max_np} allow")
    return min(slots, args.max_np)


def _fixed_hosts(args):
    """The hosts and slots of ``-H`` or ``--hostfile`` (``[(host, slots)]``), or None for a launch on this host."""
    from .elastic_driver import parse_hosts

    if args.hosts:
        return parse_hosts(args.hosts.replace(",", "\n"))
    if args.hostfile:
        with open(args.hostfile) as f:
            lines = [line.split("#")[0].split() for line in f]
        return parse_hosts("\n".join(
            f"{words[0]}:{next((w.split('=')[1] for w in words[1:] if w.startswith('slots=')), 1)}"
            for words in lines if words))
    return None


def _reset_limit(args) -> dict:
    """``--reset-limit N`` for the ranks (HPCTRAIN_ELASTIC_RESET_LIMIT)."""
    from .. import settings

    if args.reset_limit is None:
        return {}
    if args.reset_limit < 0:
        raise ValueError(f"--reset-limit must be 0 (no limit) or more, got {args.reset_limit}")
    return {settings.setting("HPCTRAIN_ELASTIC_RESET_LIMIT").name: str(args.reset_limit)}


def _launch_discovered(args, argv) -> int:
    """``--elastic --host-discovery-script S``: the ranks follow the hosts S offers (hpctrain.launcher.elastic_driver)."""
    from .. import settings
    from .cooldown import Cooldown
    from .elastic_driver import run_with_discovery, script_source
    from .elastic_run import run_elastic
    from .launch import build_command

    if args.hosts or args.hostfile or args.gloo:
        raise ValueError("--host-discovery-script names the hosts: leave out -H, --hostfile and --gloo")
    if not os.access(args.host_discovery_script, os.X_OK):
        raise FileNotFoundError(f"{args.host_discovery_script}: no executable host discovery script")
    min_np = args.min_np or args.n or 1
    max_np = args.max_np or 0
    if max_np and max_np < min_np:
        raise ValueError(f"--max-np ({max_np}) is below --min-np ({min_np})")
    _check_before_launch(argv)
    if args.dry_run:
        print(" ".join(build_command(min_np, argv, elastic=True, min_np=min_np)), flush=True)
        return 0
    settings.mark_launch_checked()
    sys.stdout.flush()
    cooldown = Cooldown(tuple(args.cooldown_range) if args.cooldown_range else None)
    return run_with_discovery(argv, script_source(args.host_discovery_script, args.slots), min_np, max_np,
                              build_command, run_elastic, exports=_reset_limit(args), cooldown=cooldown)


def _check_before_launch(argv) -> None:
    """Refuse, before any rank starts, a script that does not exist or an HPCTRAIN_* value init() would refuse.

    Unknown HPCTRAIN_* names are warnings (with the closest known name), as at init().
    """
    from .. import settings
    from ..comm.life.runtime import Config

    for line in settings.unknown_names():
        print(f"hpctrain launch: warning: {line}", file=sys.stderr)
    Config.from_env()                   # every setting init() reads, and the tuning file: SettingError (a ValueError)
    settings.get("HPCTRAIN_BACKEND")
    script = _script_of(argv)
    if script is not None and not os.path.isfile(script):
        raise FileNotFoundError(f"{script}: no such file (from {os.getcwd()}); nothing was launched")


def _script_of(argv):
    """The Python script ``argv`` runs (``python x.py``, ``x.py``), or None (``python -m m``, ``-c``, a command)."""
    args = list(argv)
    if args and os.path.basename(args[0]).startswith("python"):
        args = args[1:]
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c", "-"):
            args = args[1:]             # interpreter flags such as -u, -O
        if not args or args[0] in ("-m", "-c", "-"):
            return None
        return args[0]
    return args[0] if args and args[0].endswith(".py") else None


def _info(args) -> int:
    from .info import report

    text = report(imports=args.imports)
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


def _report(args) -> int:
    from ..observe.report import write_report

    for path in write_report(args.run_dir, args.out):
        print(path)
    return 0


def main(argv=None) -> int:
    """Run the hpctrain command line and return its exit status."""
    from .. import __version__

    parser = argparse.ArgumentParser(prog="hpctrain", description="hpctrain: distributed training tools")
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("launch", help="start N ranks of a program with mpirun (or srun in Slurm)")
    p.add_argument("-n", "-np", "--np", "--num-proc", dest="n", type=int, help="number of ranks (with "
                   "--host-discovery-script: the fewest to start with, as --min-np)")
    p.add_argument("-H", "--hosts", help="hosts and slots, host1:2,host2:2 (as horovodrun's -H)")
    p.add_argument("--hostfile", help="file of 'host slots=N' lines (as horovodrun's and mpirun's)")
    p.add_argument("--gloo", action="store_true", help="start the ranks with horovodrun --gloo")
    p.add_argument("--mpi", action="store_true", help="start the ranks with mpirun (the default; srun in Slurm)")
    p.add_argument("--start-timeout", type=float, help="seconds for the ranks to start (--gloo launches)")
    p.add_argument("--elastic", action="store_true", help="survive failed ranks: the survivors re-form the world "
                   "and go on (hpctrain.elastic; Open MPI with ULFM)")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int,
                   help="with --elastic: the fewest ranks to go on with (default 1)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int,
                   help="with --elastic: the most ranks (with -H/--hostfile: start on every slot up to it; with "
                   "--host-discovery-script: grow up to it; default: -n, or every slot the script offers)")
    p.add_argument("--host-discovery-script", help="with --elastic: an executable printing the hosts available "
                   "now, one 'host' or 'host:slots' per line; the job follows it (hosts that leave, hosts added)")
    p.add_argument("--reset-limit", type=int, help="with --elastic: end the job after this many re-formings "
                   "and restarts (as horovodrun's; default: no limit)")
    p.add_argument("--slots", "--slots-per-host", dest="slots", type=int, default=1, help="slots of a host the "
                   "discovery script prints without ':slots' (default 1)")
    p.add_argument("--elastic-timeout", type=float, help="with --elastic: seconds to wait for --min-np slots "
                   "(HPCTRAIN_ELASTIC_TIMEOUT_S; default 600)")
    p.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help="with --elastic on several hosts: a host where a rank failed is left out for MIN seconds, "
                   "twice as long each further time, at most MAX, then offered again (default: while the discovery "
                   "script lists it; with -H/--hostfile for good)")
    p.add_argument("--verbose", action="store_true", help="print the command before running it")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p.add_argument("program", nargs=argparse.REMAINDER, help="script.py args..., or a command")
    p.set_defaults(func=_launch)
    p = sub.add_parser("info", help="versions, launcher, rank layout and installed backends")
    p.add_argument("--import", dest="imports", action="store_true",
                   help="import torch, TensorFlow and Horovod (slow) to show import errors and Horovod's controllers")
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
    p = sub.add_parser("report", help="plot a run folder of per-step metrics (PNGs and summary.md)")
    p.add_argument("run_dir", help="the log_dir given to StepMetrics / track_steps / StepMetricsCallback")
    p.add_argument("--out", help="folder for the plots (default: the run folder)")
    p.set_defaults(func=_report)
    args, extras = parser.parse_known_args(argv)
    if extras:
        from .horovodrun_flags import refusal

        said = refusal(extras)
        if said is None:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        print(f"hpctrain: error: {said}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"hpctrain: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
