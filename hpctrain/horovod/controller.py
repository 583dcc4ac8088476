"""Horovod's negotiation: ranks agree by name on which collectives are ready, then run them in one order.

Horovod matches collectives by *name*, not by call order: rank 0 may start
allreduce "a" and then "b" while rank 1 starts "b" and then "a", and a rank
may wait in a barrier while an asynchronous allreduce of its own is still
open.  hpctrain's communicators run calls in program order, so this module
puts Horovod's protocol on top of them.  A background thread on every rank
runs cycles:

1. every rank contributes the requests started since its last cycle (name,
   process set, signature) and whether it has joined or shut down: one
   ``allgather_object`` over the world;
2. every rank adds them to the same table, so all agree which names are
   ready (every member of the request's process set started it; a rank that
   called ``join`` counts as started for allreduces, contributing zeros);
3. ready requests run in the order they first appeared, on the process set's
   communicator; allreduces with the same process set, dtype, op and scale
   factors are fused into one ``grouped_allreduce``.

Every collective therefore runs on this one thread, in an order all ranks
share, and the rest of hpctrain (algorithms, fusion, checks) is used as is.
Requests whose signatures differ (dtype, shape, op, root, an invalid
argument on some rank) fail on every member with the ranks and their calls
named.  A request that some ranks started and others did not for
``HPCTRAIN_STALL_WARNING_S`` is logged with the missing ranks, and fails
after ``HPCTRAIN_STALL_TIMEOUT_S``; when every rank waits on a request that
cannot complete, the oldest such request fails within seconds instead
(:mod:`hpctrain.horovod.stalls`).

Cost: one small allgather per cycle (:mod:`hpctrain.horovod.cycle_exchange`, which
waits without spinning).  A cycle follows at once while requests arrive;
while a request is open the pause doubles from 1 ms to ``HOROVOD_CYCLE_TIME``
(ms, default 5), and a rank that has started every open request it belongs
to waits inside the exchange instead.  While nothing is open no rank cycles:
each waits for a request of its own or a doorbell
(:meth:`_wait_for_doorbell` says when it answers).  Backends without
doorbells (``horovodrun --gloo``) cycle on the pause alone, up to 20 ms
while nothing is open; there the DistributedOptimizer's reductions do not
wait for cycles at all (:mod:`hpctrain.horovod.negotiated`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import settings
from ..errors import format_ranks
from .cycle_exchange import CycleExchange
from ..errors import WorldFailedError
from .pending import Entry, HorovodInternalError, OpHandle, Request, WorldFailedInHorovod
from .ready_requests import ReadyRequests
from .stalls import StallWatch, started_all_open

__all__ = ["Controller"]

log = logging.getLogger("hpctrain")

_LAZY_BELL_S = 0.05       # the longest a rank rung for a request it starts itself waits for it before cycling
_QUIET_PAUSE_S = 0.04     # the longest pause between checks for bells once none needed an answer for a while
_KEPT: list = []          # the exchanges of controllers whose world failed (elastic mode): never freed
_IDLE_PAUSE_S = 0.02      # without doorbells (Horovod carries the job): the longest pause between idle cycles


class Controller(ReadyRequests):
    """The negotiation thread of one rank over the world communicator ``world``.

    Args:
        world: hpctrain's world communicator.
        sets: the process sets, ``{id: (world ranks, communicator or None)}``;
            id 0 is the world.  The controller adds and removes entries when
            ``add_process_set``/``remove_process_set`` requests run.
        timeline: an object with ``ran``/``cycle`` (:class:`hpctrain.horovod.timeline.Timeline`)
            methods, or None.
    """

    def __init__(self, world, sets: Dict[int, Tuple[Tuple[int, ...], Any]], timeline=None):
        self.world, self.sets, self.timeline = world, sets, timeline
        self.rank, self.size = world.rank, world.size
        self._cv = threading.Condition()
        self._new: List[Request] = []
        self._mine: Dict[str, Request] = {}          # started here, not finished
        self._table: Dict[str, Entry] = {}
        self._noname: Dict[Tuple[str, int], int] = {}
        self._joined: Dict[int, int] = {}            # rank -> cycle it joined in
        self._join_handle: Optional[OpHandle] = None
        self._join_sent = False
        self._stop: tuple = ()                       # (why, exit status) once this rank stops
        self._stopped_by = ("", 1)                   # why the ranks stopped and the status to end with
        self._ended = False                          # the thread failed what was open: nothing more is taken
        self._next_set = max(sets) + 1
        self._cycle = 0
        self._pause = 0.0
        self._quiet = False                          # nothing open anywhere: wait for news or a doorbell
        self._waiting = False                        # started all it belongs to; only waits for others
        self._max_pause = float(settings.get("HOROVOD_CYCLE_TIME")) / 1000.0
        self._quiet_pause = self._max_pause         # the longest pause of the next wait for a doorbell
        self._stalls = StallWatch(self.rank, world.config.stall_warning_s, world.config.stall_timeout_s)
        self._blocked = 0                            # threads of this rank waiting on a request's handle
        self.error: Optional[BaseException] = None
        self._exchange = CycleExchange(world)
        self._thread = threading.Thread(target=self._loop, name="hpctrain-horovod", daemon=True)
        world.life.reserve_collectives(self._thread)      # from now on only this thread may issue collectives
        self._thread.start()

    # -- what the API calls ---------------------------------------------------
    def auto_name(self, kind: str, ps: int) -> str:
        """Return the next name for an unnamed request of ``kind`` on process set ``ps``."""
        with self._cv:
            n = self._noname.get((kind, ps), 0)
            self._noname[(kind, ps)] = n + 1
        return f"{kind}.noname.{ps}.{n}"

    def submit(self, name: Optional[str], kind: str, ps: int, sig: tuple, payload: Any, labels: tuple = ()
               ) -> OpHandle:
        """Start a request and return its handle; ValueError if ``name`` is already in flight here.

        ``labels``: the timeline rows of the request (see :class:`~hpctrain.horovod.pending.Request`).
        """
        if ps not in self.sets:
            raise ValueError(f"process set {ps} is not registered (removed, or added on some ranks only)")
        if self.sets[ps][1] is None:
            raise ValueError(f"this rank ({self.rank}) is not a member of process set {ps} "
                             f"(ranks {list(self.sets[ps][0])})")
        name = name if name is not None else self.auto_name(kind, ps)
        if ps:                           # names are per process set, as in Horovod
            name = f"{name}@set{ps}"
        req = Request(name, kind, ps, sig, payload, labels, owner=self)
        with self._cv:
            self._raise_if_stopped()
            if name in self._mine:
                raise ValueError(f"a {self._mine[name].kind} named {name!r} is still in flight on this rank "
                                 f"(rank {self.rank}); names of concurrent requests must be unique")
            self._mine[name] = req
            self._new.append(req)
            self._cv.notify()
        return req.handle

    def join(self) -> OpHandle:
        """Mark this rank joined; the handle's result is the rank that joined last, once all have."""
        with self._cv:
            self._raise_if_stopped()
            if self._join_handle is not None:
                raise ValueError("join() is already in progress on this rank")
            self._join_handle, self._join_sent = OpHandle("join", self), False
            self._cv.notify()
            return self._join_handle

    def stop(self, reason: str = "", exit_status: int = 0) -> None:
        """Shut down: every rank's thread ends after the next cycle and open requests fail, naming ``reason``.

        ``reason``: why, as the other ranks will read it (default: ``hvd.shutdown()`` was called on this rank);
        ``exit_status``: the status this process exits with (the others' errors carry it, so an uncaught one
        ends the job with it).
        """
        with self._cv:
            self._stop = (reason or f"hvd.shutdown() was called on rank {self.rank}", int(exit_status))
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def blocked(self, delta: int) -> None:
        """A thread of this rank starts (+1) or stops (-1) waiting on a handle (the deadlock check's input)."""
        with self._cv:
            self._blocked += delta

    def direct_failure(self) -> Optional[BaseException]:
        """Why a reduction Horovod runs by name beside the negotiation can no longer complete (None: it can).

        A rank that has joined takes no part in those (:mod:`hpctrain.horovod.negotiated`).
        """
        joined = sorted(self._joined)
        if joined and len(joined) < self.size:
            return HorovodInternalError(
                f"{format_ranks(joined)} joined (hvd.join()) while rank {self.rank}'s DistributedOptimizer reduces "
                f"gradients: uneven batches with hpctrain.horovod's DistributedOptimizer are not supported where "
                f"Horovod carries the job (horovodrun --gloo); give every rank the same number of steps")
        return self.error

    def _raise_if_stopped(self) -> None:
        if isinstance(self.error, WorldFailedError):
            raise WorldFailedInHorovod(str(self.error), self.error.failed)
        if self.error is not None or self._ended or not self._thread.is_alive():
            raise HorovodInternalError(f"Horovod has been shut down on rank {self.rank}"
                                       + (f": {self.error}" if self.error is not None else ""))

    # -- the cycle --------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._one_cycle():
                pass
        except BaseException as exc:        # the world itself failed: fail what is open
            failed = self._world_failure(exc)
            self.error = exc if failed is None else failed
            (log.error if failed is None else log.info)("hpctrain.horovod: the negotiation thread stopped: %s", exc)
        reason = self.error
        if reason is None:
            reason = HorovodInternalError(f"Horovod has been shut down: {self._stopped_by[0]}")
            reason.exit_status = self._stopped_by[1]
        with self._cv:
            self._ended = True      # (a request started from now on would wait for ever: submit() refuses it)
            for req in list(self._mine.values()) + self._new:
                req.handle._finish(error=reason)
            self._mine.clear()
            self._new = []
            if self._join_handle is not None:
                self._join_handle._finish(error=reason)
        if isinstance(self.error, WorldFailedError):
            _KEPT.append(self._exchange)    # (freeing a failed world's requests and communicator can hang)
        else:
            self._exchange.free()
        self.world.life.reserve_collectives(None)

    def _world_failure(self, exc: BaseException) -> Optional[BaseException]:
        """In elastic mode, the error for ranks that failed under the negotiation (its own doorbell exchange
        included: the whole world is revoked then); None when ``exc`` is not that."""
        exc = self.world.life.failure_policy.world_error(exc)
        return None if exc is None else WorldFailedInHorovod(str(exc), exc.failed)

    def _has_news(self) -> bool:
        """Whether this rank has something for the next cycle (call with ``_cv`` held)."""
        return bool(self._new or self._stop or (self._join_handle is not None and not self._join_sent))

    def _wait_for_doorbell(self) -> None:
        """Wait, while nothing is open anywhere, for news of this rank (then ring the others) or a doorbell.

        A bell is urgent for a rank that will not start the news itself (a
        process set without it, a join, a shutdown, or it has joined): it comes
        at once.  Otherwise (every rank starts the same requests, as in a
        training step) it waits up to ``_LAZY_BELL_S`` for its own request:
        answering at once would run a cycle without it, then idle cycles until
        it comes, each taking the training thread's core for a moment.  The
        checks for bells come at pauses doubling from 1 ms to ``HOROVOD_CYCLE_TIME``,
        or to ``_QUIET_PAUSE_S`` (fewer wake-ups in a forward pass) once the
        last few waits ended with a request of this rank's own; an urgent bell
        brings the shorter pauses back.
        """
        pause, lazy_since = 0.001, None
        longest = self._quiet_pause
        while True:
            with self._cv:
                if not self._has_news():
                    self._cv.wait(pause)
                news = self._has_news()
                urgent = self._urgent_ranks() if news else ()
            if news:
                self._exchange.ring(self._cycle, urgent)
                self._quiet_pause = min(2 * self._quiet_pause, max(_QUIET_PAUSE_S, self._max_pause))
                return
            highest, at_once = self._exchange.rung()
            if at_once >= self._cycle or (highest >= self._cycle and self.rank in self._joined):
                self._quiet_pause = self._max_pause          # bells that need an answer: check often
                return
            if highest >= self._cycle and lazy_since is None:
                lazy_since = time.monotonic()
                longest = self._max_pause                     # (so that it answers soon after the grace)
            if lazy_since is not None and time.monotonic() - lazy_since >= max(_LAZY_BELL_S, self._max_pause):
                return
            pause = min(2 * pause, longest)

    def _urgent_ranks(self) -> set:
        """The ranks that will not start this rank's news themselves (call with ``_cv`` held)."""
        if self._stop or (self._join_handle is not None and not self._join_sent):
            return set(range(self.size))
        urgent: set = set()
        for req in self._new:
            if req.ps != 0:
                urgent |= set(range(self.size)) - set(self.sets[req.ps][0] if req.ps in self.sets else ())
        return urgent

    def _one_cycle(self) -> bool:
        rung = self._quiet
        if rung:
            self._wait_for_doorbell()
        with self._cv:
            if not rung and not self._has_news() and self._pause and not self._waiting:
                self._cv.wait(self._pause)
            new, self._new = self._new, []
            joining = self._join_handle is not None and not self._join_sent
            self._join_sent = self._join_sent or joining
            stop = self._stop
            waiting = self._blocked > 0 and not new and not joining
        msg = ([(r.name, r.kind, r.ps, r.sig, r.started) for r in new], joining, stop, time.time(), waiting)
        msgs = self._exchange.allgather(msg, poll=bool(self._mine or joining or stop))
        self._cycle += 1
        now = msgs[0][3]
        if self.timeline is not None:
            self.timeline.cycle()
        busy = False
        for rank, (items, joining, _, _, _) in enumerate(msgs):
            busy = busy or bool(items) or joining
            for name, kind, ps, sig, started in items:
                entry = self._table.get(name)
                if entry is None:
                    entry = self._table[name] = Entry(kind, ps, now)
                entry.sigs[rank] = sig
                entry.first = min(entry.first, started)
                entry.arrived.setdefault(rank, now)
            if joining:
                self._joined[rank] = self._cycle
        if any(m[2] for m in msgs):
            stops = [m[2] for m in msgs if m[2]]
            self._stopped_by = ("; ".join(why for why, _ in stops), next((s for _, s in stops if s), 1))
            return False
        self._run_ready(now, [m[4] for m in msgs])
        self._finish_join()
        idle_limit = self._max_pause if self._exchange.has_doorbells else max(self._max_pause, _IDLE_PAUSE_S)
        self._pause = 0.0 if busy else min(max(2 * self._pause, 0.001), idle_limit)
        self._quiet = self._exchange.has_doorbells and not self._table
        self._waiting = started_all_open(self._table, self.rank, self._members)
        return True

    def _members(self, ps: int) -> tuple:
        return self.sets[ps][0] if ps in self.sets else ()

    # -- helpers for execute ----------------------------------------------------
    def add_set(self, ranks: Tuple[int, ...], comm) -> int:
        """Register a process set (called in the shared order, so ids agree on every rank)."""
        ps, self._next_set = self._next_set, self._next_set + 1
        self.sets[ps] = (ranks, comm)
        return ps

    def remove_set(self, ps: int) -> None:
        """Forget process set ``ps`` and free its communicator."""
        ranks, comm = self.sets.pop(ps)
        if comm is not None and ps != 0:
            comm.free()

