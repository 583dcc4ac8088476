"""What a world communicator and its sub-communicators share: settings, the op engine, the watchdog.

Collectives of one process run one at a time, in the order they were called,
whether they were called synchronously or asynchronously.  Asynchronous calls
go to a single background thread (one per process, as in Horovod); a
synchronous call first waits for the asynchronous ones issued before it and
then runs on the caller's thread, so a small blocking collective pays no
thread hand-off.  Because every rank issues its calls in program order, the
ranks meet in the same order.  Point-to-point receives have a lane of their
own, and sends are non-blocking, so messages never wait behind collectives.

The watchdog thread looks at the collective in flight: after
``HPCTRAIN_STALL_WARNING_S`` seconds it logs which call is stuck and, where
known, which ranks have not joined; after ``HPCTRAIN_STALL_TIMEOUT_S`` seconds
(0 disables) it aborts the whole job with that message instead of hanging.
It also reads the departures board (:mod:`hpctrain.comm.life.departures`): a
collective that waits for a rank that has left ends the job a few seconds
after the notice arrived; and it asks the backend which ranks failed
(:mod:`hpctrain.comm.backends.mpi.failures`): a failed rank ends the job within a period,
named with its node.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

from ... import settings
from ...hooks import Hooks
from ..recording.comm_log import CommLog
from .failure_policy import policy_for
from .lane import InFlight, Lane
from ..recording.timeline import Timeline

__all__ = ["Config", "Runtime", "Lane", "InFlight"]

log = logging.getLogger("hpctrain")


@dataclass(frozen=True)
class Config:
    """Settings read once at ``init()``: each field is the setting HPCTRAIN_<FIELD> of
    :mod:`hpctrain.settings` (meaning and default are there), else the tuning file's value."""

    check: bool = settings.default("HPCTRAIN_CHECK")
    comm_log: bool = settings.default("HPCTRAIN_COMM_LOG")
    timeline: str = settings.default("HPCTRAIN_TIMELINE")
    stall_warning_s: float = settings.default("HPCTRAIN_STALL_WARNING_S")
    stall_timeout_s: float = settings.default("HPCTRAIN_STALL_TIMEOUT_S")
    ring_chunk_bytes: int = settings.default("HPCTRAIN_RING_CHUNK_BYTES")
    shm_min_bytes: int = settings.default("HPCTRAIN_SHM_MIN_BYTES")
    hierarchical_min_bytes: int = settings.default("HPCTRAIN_HIERARCHICAL_MIN_BYTES")
    link_gbit: float = settings.default("HPCTRAIN_LINK_GBIT")
    link_latency_us: float = settings.default("HPCTRAIN_LINK_LATENCY_US")
    memory_gbps: float = settings.default("HPCTRAIN_MEMORY_GBPS")
    shm_small_bytes: int = settings.default("HPCTRAIN_SHM_SMALL_BYTES")
    fusion_threshold: int = settings.default("HPCTRAIN_FUSION_THRESHOLD")
    shm_arena_bytes: int = settings.default("HPCTRAIN_SHM_ARENA_BYTES")
    native_kernel: bool = settings.default("HPCTRAIN_NATIVE_KERNEL")
    cross_memory: bool = settings.default("HPCTRAIN_CROSS_MEMORY")
    elastic: bool = settings.default("HPCTRAIN_ELASTIC")

    @classmethod
    def from_env(cls) -> "Config":
        """Return the settings: defaults, then the tuning file, then HPCTRAIN_* environment variables."""
        tuned = read_tuning()
        values = {}
        for field in cls.__dataclass_fields__:
            setting = settings.setting("HPCTRAIN_" + field.upper())
            if field in tuned:      # the file's value is checked like the variable's would be
                setting.check(tuned[field], f"{field}={tuned[field]} in the tuning file {tuning_path()} "
                                            f"(as {setting.name})")
            values[field] = settings.get(setting.name, default=tuned.get(field))
        return cls(**values)


# The settings every rank of a world must hold alike (``init()`` compares them): they decide which algorithm
# a collective runs, how it splits its buffers and whether calls are checked, so ranks that differ would run
# different collectives.  (Others may differ: stall times, output paths, HPCTRAIN_CROSS_MEMORY, the C kernel.)
SHARED_SETTINGS = ("check", "ring_chunk_bytes", "shm_min_bytes", "hierarchical_min_bytes", "link_gbit",
                   "link_latency_us", "memory_gbps", "shm_small_bytes", "fusion_threshold", "shm_arena_bytes",
                   "elastic")

TUNABLE = ("ring_chunk_bytes", "shm_min_bytes", "hierarchical_min_bytes", "shm_small_bytes", "fusion_threshold",
           "shm_arena_bytes")


def tuning_path() -> str:
    """Return where ``hpctrain tune`` writes and ``init()`` reads thresholds.

    HPCTRAIN_TUNE_FILE, else ``$XDG_CONFIG_HOME/hpctrain/tune.json`` (``~/.config``).
    """
    explicit = settings.get("HPCTRAIN_TUNE_FILE")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "hpctrain", "tune.json")


def read_tuning() -> dict:
    """Return the thresholds of the tuning file (empty without one); a malformed file is an error."""
    path = tuning_path()
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the hpctrain tuning file {path}: {exc} "
                         f"(rerun `hpctrain tune` or delete it)") from exc
    values = data.get("thresholds", {}) if isinstance(data, dict) else None
    if not isinstance(values, dict) or not all(
            k in TUNABLE and isinstance(v, int) and v >= 0 for k, v in values.items()):
        raise ValueError(f"the hpctrain tuning file {path} is malformed: expected "
                         f"{{\"thresholds\": {{name: bytes}}}} with names from {', '.join(TUNABLE)}")
    return values


class Runtime:
    """Shared state of one initialized world: settings, the call lanes and the watchdog.

    Collectives of every communicator share one lane (they must meet in the
    same order on every rank).  Receives of point-to-point messages have their
    own lane, so a receive never waits behind a collective or vice versa;
    sends are non-blocking and need no lane.

    Args:
        config: the settings.
        world_rank: this process's rank in the world (for messages).
        abort: called with a message and an exit status to end the whole job (never returns).
        departures: the backend's board of leaving notices (:mod:`hpctrain.comm.life.departures`), or None.
        failures: the backend's detector of failed ranks (``failed()``, ``settled()``, ``describe()``), or None.
        is_failure: the backend's test of an exception for "a rank failed" (default: never).
    """

    def __init__(self, config: Config, world_rank: int, abort: Callable[[str], None], departures=None,
                 failures=None, is_failure: Optional[Callable[[BaseException], bool]] = None):
        self.config = config
        self.world_rank = world_rank
        self._abort = abort
        self.collectives = Lane("collectives")
        self.receives = Lane("receives")
        self.close_hooks = Hooks("close", last_first=True)     # run by close() first: see WorldLife.on_close
        self.interrupt_hooks = Hooks("interrupt")     # what a Ctrl-C leaves behind: see Communicator.on_interrupt
        self.departures = departures   # a departures.Departures where the backend sends leaving notices
        self.failures = failures       # a failures.FailureDetector where the backend can name failed ranks
        self.owner: Optional[threading.Thread] = None   # when set, the only thread that may issue collectives
        # the backend's "this exception says a rank failed"
        self.is_failure: Callable[[BaseException], bool] = is_failure or (lambda exc: False)
        self.comm_log = CommLog(on=config.comm_log)     # see comm_log.py
        self.timeline = Timeline(on=bool(config.timeline))   # see timeline.py
        self.closed = False
        self.policy = policy_for(self)  # what failed ranks do (failure_policy.py): the one reader of config.elastic
        self._watchdog = threading.Thread(target=self._watch, name="hpctrain-watchdog", daemon=True)
        self._watchdog.start()

    def run(self, fn: Callable[[], object], text: Union[str, Callable[[], str]], members: Tuple[int, ...] = ()
            ) -> object:
        """Run a collective now, after the asynchronous ones issued before it."""
        if self.owner is not None:
            self._check_owner()
        policy = self.policy            # (outside elastic mode the call itself: nothing added per call)
        return self.collectives.run(policy.guard(fn) if policy.reforms else fn, text, members)

    def submit(self, fn: Callable[[], object], text: Union[str, Callable[[], str]], members: Tuple[int, ...] = ()
               ) -> Future:
        """Queue a collective for the background thread and return a Future of its result."""
        if self.owner is not None:
            self._check_owner()
        policy = self.policy
        return self.collectives.submit(policy.guard(fn) if policy.reforms else fn, text, members)

    def _check_owner(self) -> None:
        """Refuse a collective from another thread than ``owner`` (hpctrain.horovod's negotiation thread)."""
        owner = self.owner
        if owner is not None and threading.current_thread() is not owner:
            from ...errors import HpctrainError
            raise HpctrainError("hpctrain.horovod is initialised: its negotiation thread issues every collective "
                                "of this process, so hpctrain's own collectives cannot run beside it (they could "
                                "cross a Horovod request on another rank); use the hvd functions, or call "
                                "hvd.shutdown() first")

    def note_waiting(self, waiting_on: str) -> None:
        """Record who the collective in flight is waiting for (shown by the watchdog)."""
        cur = self.collectives.inflight
        if cur is not None:
            cur.waiting_on = waiting_on

    def close(self, exit_status: int = 0) -> None:
        """Run the ``on_close`` callbacks, let queued collectives finish, print the comm log, then leave.

        A callback that raises does not stop the others or the leaving: each
        failure is printed on this rank at once, naming the callback, and after
        this rank has left with the others :class:`~hpctrain.errors.ShutdownError`
        is raised with all of them.  Leaving waits for the other ranks at most
        ``HPCTRAIN_STALL_TIMEOUT_S`` (see :meth:`Departures.leave`); ``exit_status``
        travels in the leaving notice.
        """
        failures = []
        for what, cb in self.close_hooks.take_all():
            try:
                cb()
            except Exception as exc:  # noqa: BLE001 - reported below, after the rank has left
                failures.append((what, exc))
                sys.stderr.write(f"hpctrain: rank {self.world_rank}: {what} failed at shutdown: "
                                 f"{type(exc).__name__}: {exc}\n")
                sys.stderr.flush()
        self.collectives.close(drain=True)
        self.receives.close(drain=False)
        self.closed = True
        gone = self.policy.at_close()   # (failed ranks a failure handler let the job go on without never leave)
        if self.failures is not None:
            self.failures.free()
        if self.config.comm_log and self.world_rank == 0:
            table = self.comm_log.table()
            if table:
                try:
                    print(table, flush=True)
                except (OSError, ValueError) as exc:     # (a closed or broken stdout)
                    failures.append(("the communication log's table", exc))
                    sys.stderr.write(f"hpctrain: rank 0: the communication log's table failed at shutdown: "
                                     f"{type(exc).__name__}: {exc}\n")
        if self.departures is not None:      # no collective is left on this rank: leave, with the others
            board, self.departures = self.departures, None
            late = board.leave(self.config.stall_warning_s, self.config.stall_timeout_s, exit_status, gone)
            if late:
                from ...errors import format_ranks

                self._abort(f"hpctrain: rank {self.world_rank} has finished and waited "
                            f"{self.config.stall_timeout_s:g} s (HPCTRAIN_STALL_TIMEOUT_S) for world "
                            f"{format_ranks(late)} to finish too; aborting the job", exit_status or 1)
        if failures:
            from ...errors import ShutdownError

            said = "; ".join(f"{what} failed at shutdown: {type(exc).__name__}: {exc}" for what, exc in failures)
            raise ShutdownError(f"rank {self.world_rank}: {said}") from failures[0][1]

    def discard(self) -> None:
        """Stop this runtime without leaving (elastic mode: the world re-forms without ranks that failed).

        The lanes stop after their queued calls, which raise at once since
        ranks failed; the watchdog stops; nothing is announced to the other
        ranks and no ``on_close`` callback runs (they hold the old world).
        """
        self.closed = True
        self.close_hooks.take_all()
        self.collectives.close(drain=True)
        self.receives.close(drain=False)
        if self.failures is not None:
            self.failures.discard()                 # (its heartbeat: the new world has its own)
        self.departures = self.failures = None      # (their communicators are left to the old world's end)

    def abort(self, message: str, code: int = 1) -> None:
        """End the whole job with ``message`` and exit status ``code`` (never returns)."""
        self._abort(message, code)

    # -- watchdog ------------------------------------------------------
    def failure_message(self) -> str:
        """Say which world ranks failed and on which nodes, and what this rank waits in ("" if none is known)."""
        detector = self.failures
        failed = detector.settled() if detector is not None else []
        if failed and self.departures is not None:       # (survivors that left after naming them are no news)
            left = self.departures.update()
            failed = [r for r in failed if r not in left]
        if not failed:
            return ""
        cur = self.collectives.inflight
        waits = f" while this rank waits in {cur.describe()}" if cur is not None else ""
        return (f"hpctrain: rank {self.world_rank}: {detector.describe(failed)} failed (the process died or its node "
                f"was lost){waits}; aborting the job")

    def exit_after_failure(self, message: str, code: int = 1) -> None:
        """End this process after ranks failed (see :func:`hpctrain.comm.life.abort.exit_after_failure`), telling the
        others it leaves so that they name only the ranks that failed."""
        from .abort import exit_after_failure

        board = self.departures
        if board is not None:
            try:
                board._announce(code)
            except Exception:  # noqa: BLE001 - the failure is what must be said
                pass
        exit_after_failure(message, code)

    def _check_departures(self) -> None:
        """End the job when the collective in flight waits for a rank that has left (see departures.py)."""
        cur, board = self.collectives.inflight, self.departures
        if board is None or cur is None or not cur.members or time.monotonic() - cur.start < 1.0:
            return              # (a call that has not waited a second is not held up by anyone yet)
        board.update()
        gone = board.blocking(cur.members, cur.start, time.monotonic())
        if gone and not self.closed:
            self._abort(f"hpctrain: rank {self.world_rank}: {board.describe(gone)} while this rank waits for it in "
                        f"{cur.describe()}; it will never join, aborting the job", board.exit_status(gone))

    def _watch(self):
        cfg = self.config
        period = max(0.05, min(1.0, cfg.stall_warning_s / 4))
        while not self.closed:
            time.sleep(period)
            self.policy.watch()
            self._check_departures()
            for lane in (self.collectives, self.receives):
                cur = lane.inflight
                if cur is None or not cur.watched:
                    continue
                elapsed = time.monotonic() - cur.start
                detail = f"; {cur.waiting_on}" if cur.waiting_on else ""
                if elapsed >= cfg.stall_warning_s and not cur.warned:
                    cur.warned = True
                    log.warning("hpctrain: rank %d: %s has not finished after %.0f s%s",
                                self.world_rank, cur.describe(), elapsed, detail)
                if cfg.stall_timeout_s and elapsed >= cfg.stall_timeout_s:
                    self._abort(f"hpctrain: rank {self.world_rank}: {cur.describe()} stalled for {elapsed:.0f} s "
                                f"(HPCTRAIN_STALL_TIMEOUT_S={cfg.stall_timeout_s:g}){detail}; aborting the job")
