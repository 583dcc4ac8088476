"""The elastic launcher with a host discovery script: start the job on the hosts it offers, tell the ranks of
changes, and start the job again on more hosts.

``hpctrain launch --elastic --host-discovery-script S [--min-np A] [--max-np B] [--slots K] train.py``:

1. runs ``S`` (Horovod's format: one ``host`` or ``host:slots`` per line; a
   bare host has ``--slots`` slots) until it offers at least ``A`` slots
   (``HPCTRAIN_ELASTIC_TIMEOUT_S``), then starts ``min(slots, B)`` ranks on
   them with mpirun, ranks filling the hosts in order;
2. while the job runs, runs ``S`` every ``HPCTRAIN_ELASTIC_DISCOVERY_S``
   seconds and, when what it offers changes, writes the hosts to
   ``<control>/hosts.json`` with a new version: the ranks act on it at their
   next commit (:mod:`hpctrain.elastic.hosts`: ranks on hosts that left end,
   the others re-form; more slots restart the job).  A host where a rank
   failed is left out of what is offered (its other ranks leave too, as
   Horovod blacklists it) until ``S`` stops listing it and lists it again,
   or with ``--blacklist-cooldown-range MIN MAX`` until its cooldown ends
   (:mod:`hpctrain.launcher.cooldown`);
3. when the job ended for a restart (``<control>/restart.json``), starts it
   again on the hosts offered now (those of the last world first, so rank 0
   keeps its host), with ``HPCTRAIN_ELASTIC_RESUME=1``;
4. when the job ended because a node was lost with Open MPI's daemon on it
   (a node crash: Open MPI's runtime then ends the whole job, the survivors'
   processes and in-memory commits too, whatever ULFM does for the ranks),
   starts it again on the other hosts: the ranks start from what the script
   loads at its start (its newest disk checkpoint), as after torchrun's
   restart.  :func:`run_fixed_hosts` does the same for ``-H`` / ``--hostfile``
   launches (whose failed ranks' hosts keep their other ranks); with
   ``--blacklist-cooldown-range`` fixed hosts go through 1-3 as a script that
   always lists them, so that a host left out comes back after its cooldown.
   Each such restart counts one reset towards ``--reset-limit``,
   on top of the resets the ranks had before (rank 0 writes their count to
   ``<control>/resets.json`` after each one); the next start is told the sum
   (``HPCTRAIN_ELASTIC_RESETS_DONE``).

The control folder (``.hpctrain-elastic/<launcher pid>`` in the current
directory: with a discovery script the ranks of every host must see it; with
fixed hosts rank 0's host should, else only restarts are counted) is removed
at the end.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import settings
from .cooldown import Cooldown
from ..launcher_protocol import HOSTS_FILE, RESETS_FILE, RESTART_FILE, WORLD_FILE, read_json, write_json

__all__ = ["parse_hosts", "discover", "script_source", "DiscoveryError", "run_with_discovery", "run_fixed_hosts"]

Hosts = List[Tuple[str, int]]


class DiscoveryError(RuntimeError):
    """The host discovery script failed or printed a line that names no host."""


def parse_hosts(text: str, default_slots: int = 1) -> Hosts:
    """``[(host, slots)]`` from a discovery script's output (``host`` or ``host:slots`` per line, in order)."""
    hosts: Dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, count = line.partition(":")
        try:
            slots = int(count) if count else default_slots
        except ValueError:
            raise DiscoveryError(f"the host discovery script printed {line!r}: expected host or host:slots") \
                from None
        if not name or slots < 0:
            raise DiscoveryError(f"the host discovery script printed {line!r}: expected host or host:slots")
        hosts[name] = hosts.get(name, 0) + slots
    return [(h, s) for h, s in hosts.items() if s > 0]


def discover(script: str, default_slots: int = 1, timeout: float = 30.0) -> Hosts:
    """Run the discovery script once and return the hosts it offers (DiscoveryError when it fails)."""
    try:
        out = subprocess.run([script], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        raise DiscoveryError(f"the host discovery script {script} could not run: {exc}") from None
    if out.returncode != 0:
        raise DiscoveryError(f"the host discovery script {script} exited with status {out.returncode}: "
                             f"{out.stderr.strip()[-500:]}")
    return parse_hosts(out.stdout, default_slots)


class _Watch:
    """What the launcher offers the running job: the source's hosts less those where a rank failed (cooldown.py)."""

    def __init__(self, source: Callable[[], Hosts], control: str, cooldown: Optional[Cooldown] = None):
        self.source, self.control = source, control
        self.cooldown = cooldown or Cooldown()
        self.version = 0
        self.seen: Hosts = []             # the source's newest answer
        self.posted: Hosts = []           # what the ranks were offered last (hosts.json)
        self.launched: Dict[str, int] = {}    # ranks per host at the job's start
        self.world: Optional[dict] = None     # the ranks' world.json last looked at
        self.warned = False

    def offered(self) -> Hosts:
        out = self.cooldown.left_out()
        return [(h, s) for h, s in self.seen if h not in out]

    def post(self, hosts: Hosts) -> None:
        self.version += 1
        self.posted = list(hosts)
        write_json(os.path.join(self.control, HOSTS_FILE),
                   {"version": self.version, "hosts": [list(h) for h in hosts], "time": time.time()})

    def poll(self) -> None:
        """Ask the source once and post what changed (called every HPCTRAIN_ELASTIC_DISCOVERY_S while the job runs).

        A host with fewer ranks in the ranks' newest world than it was offered
        and started with had a rank fail: it is left out (its other ranks leave
        too, as horovodrun blacklists it) for its cooldown, or until the script
        stops listing it.
        """
        try:
            self.seen = self.source()
        except DiscoveryError as exc:
            if not self.warned:
                sys.stderr.write(f"hpctrain launch: {exc}; keeping the hosts of its last answer\n")
                self.warned = True
            return
        names = {h for h, _ in self.seen}
        self.cooldown.forgive(set(self.cooldown.until) - names)   # (a host the script dropped comes back as new)
        world = read_json(os.path.join(self.control, WORLD_FILE))
        if world is not None and world != self.world:            # (judged once: a cooldown may end before the
            self.world = world                                     # world has grown back onto the host)
            now = Counter(world["hosts"])
            posted = dict(self.posted)
            self.cooldown.leave_out(h for h, n in self.launched.items()
                                    if now.get(h, 0) < min(n, posted.get(h, 0)) and h in names)
            for h, n in now.items():      # (ranks spawned into the running world count as started there)
                self.launched[h] = max(self.launched.get(h, 0), n)
        if self.offered() != self.posted:
            self.post(self.offered())


def script_source(script: str, slots: int) -> Callable[[], Hosts]:
    """The hosts a discovery script offers, asked anew at each call (DiscoveryError when it fails)."""
    return lambda: discover(script, slots)


def _order(hosts: Hosts, first: Sequence[str]) -> Hosts:
    """``hosts`` with those named in ``first`` (the last world's, in its order) ahead of the others."""
    rank = {h: i for i, h in enumerate(dict.fromkeys(first))}
    return sorted(hosts, key=lambda hs: rank.get(hs[0], len(rank)))


def run_with_discovery(argv: List[str], source: Callable[[], Hosts], min_np: int, max_np: int,
                       build: Callable[..., List[str]], run: Callable[..., int],
                       exports: Optional[Dict[str, str]] = None, cooldown: Optional[Cooldown] = None) -> int:
    """Run the elastic job on the hosts ``source()`` offers, restarting it on more (module docstring); its status.

    ``source`` is :func:`script_source` of the discovery script, or fixed
    hosts with ``--blacklist-cooldown-range`` (a host left out comes back
    after its ``cooldown``).  ``build(n, argv, hosts=..., elastic=True,
    min_np=..., exports=...)`` makes mpirun's command
    (:func:`hpctrain.launcher.launch.build_command`) and ``run(cmd, watch=...)``
    runs it (:func:`hpctrain.launcher.elastic_run.run_elastic`); ``exports`` are
    more settings for the ranks.
    """
    with _control_folder() as control:
        watch = _Watch(source, control, cooldown)
        hosts = _wait_for_hosts(watch, min_np)
        resume, starts, resets = False, 0, 0
        while True:
            n = min(sum(s for _, s in hosts), max_np) if max_np else sum(s for _, s in hosts)
            names = [h for h, s in hosts for _ in range(s)][:n]
            watch.launched, watch.world = Counter(names), None
            watch.post(hosts)
            for name in (RESTART_FILE, WORLD_FILE):
                _remove(os.path.join(control, name))
            env = {**_ranks_env(control, resets, exports),
                   settings.setting("HPCTRAIN_ELASTIC_HOSTS_VERSION").name: str(watch.version),
                   settings.setting("HPCTRAIN_ELASTIC_RANK_HOSTS").name: ",".join(names),
                   settings.setting("HPCTRAIN_ELASTIC_MAX_NP").name: str(max_np)}
            if resume:
                env[settings.setting("HPCTRAIN_ELASTIC_RESUME").name] = "1"
            cmd = build(n, argv, hosts=",".join(f"{h}:{s}" for h, s in hosts), elastic=True,
                        min_np=min(min_np, n), exports=env)
            lost: set = set()
            code = run(cmd, watch=watch.poll, lost=lost)
            starts += 1
            restart = read_json(os.path.join(control, RESTART_FILE))
            if lost and restart is None:
                watch.cooldown.leave_out(lost)
                resets = _resets_before(control, resets) + 1
                hosts = _after_node_loss(lost, watch.offered(), min_np, starts, resets, exports)
                if hosts is None:
                    return code or 1
                resume = False         # (a commit written for an earlier restart is older than the disk's)
                continue
            if code != 0 or restart is None:
                return code
            world = read_json(os.path.join(control, WORLD_FILE)) or {"hosts": names}
            hosts = _order(watch.offered() or hosts, world["hosts"])
            resume, resets = True, int(restart.get("resets", 0))
            sys.stdout.write(f"hpctrain launch: restarting the elastic job on {', '.join(f'{h}:{s}' for h, s in hosts)}"
                             f" from commit {restart['commit']} (start {starts + 1})\n")
            sys.stdout.flush()


def run_fixed_hosts(n: int, argv: List[str], hosts: Hosts, min_np: int, build: Callable[..., List[str]],
                    run: Callable[..., int], exports: Optional[Dict[str, str]] = None) -> int:
    """Run an elastic job on fixed hosts (``-H``, ``--hostfile``); after the loss of a node's daemon start it again
    on the other hosts (module docstring, 4); its status."""
    with _control_folder(required=False) as control:
        starts, resets = 0, 0
        while True:
            lost: set = set()
            code = run(build(n, argv, hosts=",".join(f"{h}:{s}" for h, s in hosts), elastic=True,
                             min_np=min(min_np, n), exports=_ranks_env(control, resets, exports)), lost=lost)
            starts += 1
            if not lost:
                return code
            resets = _resets_before(control, resets) + 1
            left = _after_node_loss(lost, [(h, s) for h, s in hosts if h not in lost], min_np, starts, resets,
                                    exports)
            if left is None:
                return code or 1
            hosts, n = left, min(n, sum(s for _, s in left))


@contextmanager
def _control_folder(required: bool = True) -> Iterator[Optional[str]]:
    """The launcher's control folder (``.hpctrain-elastic/<pid>`` here), removed at the end; None (with a warning)
    when it cannot be made and is not ``required``."""
    control = os.path.abspath(os.path.join(".hpctrain-elastic", str(os.getpid())))
    try:
        os.makedirs(control, exist_ok=True)
    except OSError as exc:
        if required:
            raise
        sys.stderr.write(f"hpctrain launch: cannot make the elastic control folder ({exc}): a restart after a lost "
                         f"node counts only the restarts towards --reset-limit\n")
        control = None
    if control is None:          # (yielded outside the handler: the job's own errors are not chained to it)
        yield None
        return
    try:
        yield control
    finally:
        shutil.rmtree(control, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(control))
        except OSError:
            pass


def _ranks_env(control: Optional[str], resets: int, exports: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The settings every start gives the ranks: ``exports``, the control folder and the resets done before."""
    env = dict(exports or {})
    if control is not None:
        env[settings.setting("HPCTRAIN_ELASTIC_CONTROL").name] = control
    if resets:
        env[settings.setting("HPCTRAIN_ELASTIC_RESETS_DONE").name] = str(resets)
    return env


def _resets_before(control: Optional[str], resets: int) -> int:
    """The job's resets before the run that just ended: the ranks' count (``resets.json``), else ``resets``."""
    done = (read_json(os.path.join(control, RESETS_FILE)) if control is not None else None) or {}
    return max(resets, int(done.get("resets", 0)))


def _after_node_loss(lost: set, left: Hosts, min_np: int, starts: int, resets: int,
                     exports: Optional[Dict[str, str]]):
    """The hosts to start the job again on after ``lost`` went with their daemons, or None (with the reason) when
    fewer than ``min_np`` slots are left or the reset limit is reached (``resets``: this restart included)."""
    slots = sum(s for _, s in left)
    limit = int((exports or {}).get(settings.setting("HPCTRAIN_ELASTIC_RESET_LIMIT").name, 0))
    said = (f"hpctrain launch: node {', '.join(sorted(lost))} was lost with Open MPI's daemon on it, which ends "
            f"the whole Open MPI job (the survivors' processes and in-memory commits too)")
    if slots < max(min_np, 1):
        sys.stderr.write(f"{said}; {slots} slot(s) left on {', '.join(h for h, _ in left) or 'no host'}, fewer "
                         f"than --min-np {min_np}: the job ends\n")
        return None
    if limit and resets > limit:
        sys.stderr.write(f"{said}; the reset limit ({limit}) is reached (a restart now would be reset {resets}, "
                         f"re-formings and restarts of the ranks counted): the job ends\n")
        return None
    sys.stdout.write(f"{said}; restarting the elastic job on {', '.join(f'{h}:{s}' for h, s in left)} "
                     f"(start {starts + 1}): the ranks start from what the script loads at its start "
                     f"(its newest disk checkpoint)\n")
    sys.stdout.flush()
    return left


def _wait_for_hosts(watch: _Watch, min_np: int) -> Hosts:
    """The script's hosts once they offer ``min_np`` slots; DiscoveryError after HPCTRAIN_ELASTIC_TIMEOUT_S."""
    deadline = time.monotonic() + settings.get("HPCTRAIN_ELASTIC_TIMEOUT_S")
    while True:
        watch.seen = watch.source()
        if sum(s for _, s in watch.seen) >= min_np:
            return watch.seen
        if time.monotonic() > deadline:
            raise DiscoveryError(f"the host discovery script offers {sum(s for _, s in watch.seen)} slot(s), "
                                 f"fewer than --min-np {min_np}, after {settings.get('HPCTRAIN_ELASTIC_TIMEOUT_S'):g}"
                                 f" s (HPCTRAIN_ELASTIC_TIMEOUT_S); nothing was launched")
        time.sleep(settings.get("HPCTRAIN_ELASTIC_DISCOVERY_S"))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


ORPHANED_GRACE_S = 15.0   # how long mpirun may outlive the last of its ranks before the launcher ends it


def end_if_orphaned(proc: subprocess.Popen, grace_s: float = ORPHANED_GRACE_S) -> threading.Event:
    """End ``proc`` (mpirun) once every rank it started has ended and it has not followed within ``grace_s``.

    Open MPI 5.0's launcher has been seen to deadlock in its event loop (a
    lock it never gets) after the survivors of a rank's failure end a job with
    ``MPI_Abort`` under the fault-tolerance extension: every rank gone, mpirun
    waiting forever.  Only mpirun's own child processes are looked at (one
    poll a second), so a job across hosts, whose mpirun keeps its remote
    shells to the end, is never ended by this.  The returned event is set when
    it ended ``proc``.
    """
    import psutil

    ended = threading.Event()

    def loop():
        seen, since = False, None
        while proc.poll() is None:
            time.sleep(1.0)
            try:
                alive = bool(psutil.Process(proc.pid).children())
            except psutil.Error:
                return
            seen = seen or alive
            since = None if alive or not seen else (since or time.monotonic())
            if since is not None and time.monotonic() - since > grace_s and proc.poll() is None:
                ended.set()
                proc.kill()
    threading.Thread(target=loop, name="hpctrain-orphaned-mpirun", daemon=True).start()
    return ended


def end_if_stuck(proc: subprocess.Popen, ended: threading.Event, grace_s: float = ORPHANED_GRACE_S) -> None:
    """Kill ``proc`` (mpirun) if it has not exited ``grace_s`` after now, when the job said it finished; set ``ended``.

    Rank 0 says so at its exit, after every rank's shutdown: an mpirun still
    running then waits for a daemon that cannot answer (a frozen or cut-off
    node whose kernel keeps its connections: PRRTE waits for it for ever).
    """
    def check():
        if proc.poll() is None:
            ended.set()
            proc.kill()
    timer = threading.Timer(grace_s, check)
    timer.daemon = True
    timer.start()


def poll_while(proc: subprocess.Popen, watch: Optional[Callable[[], None]]) -> Optional[threading.Thread]:
    """Call ``watch()`` every HPCTRAIN_ELASTIC_DISCOVERY_S seconds on a daemon thread until ``proc`` ends."""
    if watch is None:
        return None
    interval = settings.get("HPCTRAIN_ELASTIC_DISCOVERY_S")

    def loop():
        while proc.poll() is None:
            time.sleep(interval)
            if proc.poll() is None:
                watch()
    thread = threading.Thread(target=loop, name="hpctrain-discovery", daemon=True)
    thread.start()
    return thread
