"""The path every collective call takes: planned, checked across ranks, run in the lane, converted back.

A part of :class:`hpctrain.comm.base.Communicator` (``comm._calls``; it reads
the communicator's runtime, size, name, call counter ``_seq``, reductions and
the backend's ``exchange_calls``).  A plan is ``(call, work, restore)``
(:mod:`hpctrain.comm.call.handle`): ``build`` makes one (an invalid argument
becomes part of the call, so every rank hears of it), ``run`` and
``submit`` run it in the collective lane (blocking, or behind a
:class:`Handle`), ``task`` wraps the work in the call check and, while they
are on, the comm log and the timeline; ``repeat`` runs a repeated call from
its remembered plan (:mod:`hpctrain.comm.call.repeated_calls`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from ...errors import CollectiveMismatchError
from ..recording.comm_log import call_bytes
from .handle import Handle, Plan, CarriedByCheck, same as _same
from .repeated_calls import NOT_REPEATED
from .signature import Call

__all__ = ["CallPath"]


class CallPath:
    """Planning, checking and running the calls of the communicator ``comm`` (see the module docstring)."""

    def __init__(self, comm):
        self._c, self._rt, self._backend = comm, comm._rt, comm._backend
        self._size, self.name, self.world_ranks = comm._size, comm.name, comm.world_ranks
        self._reductions = comm._reductions

    def next_seq(self) -> int:
        c = self._c
        c._seq += 1
        return c._seq

    def build(self, kind: str, build: Callable[[int], Plan], **hints) -> Plan:
        """Run ``build(seq)``; an invalid argument becomes part of the call so every rank hears of it."""
        seq = self.next_seq()
        try:
            return build(seq)
        except (TypeError, ValueError) as exc:
            if not self._rt.config.check or self._size == 1:
                raise
            return Call(kind, seq, error=f"{type(exc).__name__}: {exc}", **hints), None, _same

    def repeat(self, x: Any, call: tuple) -> Any:
        """Run ``call`` on ``x`` through its repeat path (a repeated call, see :mod:`hpctrain.comm.call.repeated_calls`), or
        return NOT_REPEATED (none remembered, or the comm log or timeline is on: they observe planned calls)."""
        red = self._reductions
        if type(x) not in red.repeat_types or self._rt.comm_log.on or self._rt.timeline.on:
            return NOT_REPEATED
        repeat = red.repeats.get((type(x), x.dtype, x.shape) + call)
        return NOT_REPEATED if repeat is None else repeat(x)

    def run(self, plan: Plan) -> Any:
        call, work, restore = plan
        log = self._rt.comm_log
        start = time.perf_counter() if log.on else None
        try:
            return restore(self._rt.run(self.task(call, work), lambda: f"{call.text()} #{call.seq} on {self.name}",
                                        self.world_ranks))
        finally:
            if start is not None:
                log.add_blocked(time.perf_counter() - start)

    def submit(self, plan: Plan) -> Handle:
        call, work, restore = plan
        log = self._rt.comm_log
        return Handle(self._rt.submit(self.task(call, work), lambda: f"{call.text()} #{call.seq} on {self.name}",
                                      self.world_ranks), restore, log if log.on else None)

    def task(self, call: Call, work: Optional[Callable[[], Any]]) -> Callable[[], Any]:
        carried = work if isinstance(work, CarriedByCheck) else None
        rt = self._rt

        def task(checked=None):
            if self._size > 1 and (rt.config.check or carried is not None):
                verdict = self._backend.exchange_calls(call, carried)
                if verdict:
                    raise CollectiveMismatchError(verdict, every_rank=True)
                rt.note_waiting("all ranks joined; the data transfer has not finished")
            if checked is not None:
                checked.append(time.perf_counter())
            return carried.finish() if carried is not None else work()

        log, tl = rt.comm_log, rt.timeline
        if not (log.on or tl.on):
            return task
        issued = time.perf_counter()

        def observed():
            marks = [time.perf_counter()]
            out = task(marks)
            end = time.perf_counter()
            nbytes = call_bytes(call, self._size)
            if log.on:
                log.record(call.kind, self._size, nbytes, end - marks[0])
            if tl.on:
                tl.collective(call, self.name, nbytes, issued, marks[0], marks[1], end)
            return out
        return observed

    def check_rank(self, value, what) -> None:
        """Raise ValueError unless ``value`` is a rank of this communicator (``what``: "root", "dest", ...)."""
        if not isinstance(value, (int, np.integer)) or not 0 <= value < self._size:
            raise ValueError(f"{what} {value!r} is not a rank of {self.name} (size {self._size})")
