"""Collective lanes: calls that run one at a time in the order they were made, and the record of the one in flight.

A :class:`Lane` runs a synchronous call on the caller's thread after the
asynchronous calls issued before it, and asynchronous calls on one worker
thread; its ``inflight`` (an :class:`InFlight`) is what the watchdog of
:mod:`hpctrain.comm.life.runtime` reads.
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, Tuple, Union

__all__ = ["InFlight", "Lane"]


class InFlight:
    """The collective being executed, as the watchdog sees it (``text`` may be a function that returns it)."""

    __slots__ = ("text", "start", "waiting_on", "warned", "members", "watched")

    def __init__(self, text: Union[str, Callable[[], str]], start: float, members: Tuple[int, ...] = (),
                 watched: bool = True):
        self.text, self.start, self.waiting_on, self.warned = text, start, "", False
        self.members = members      # world ranks of the call's communicator (for departures)
        self.watched = watched      # False: waiting is the caller's job (a server's receive), no stall warning

    def describe(self) -> str:
        """Return the call as text (formatted only when someone reads it)."""
        return self.text() if callable(self.text) else self.text


class Lane:
    """Calls that run one at a time in the order they were made, inline or on a background thread.

    A synchronous call first waits for the asynchronous calls issued before it
    and then runs on the caller's thread; asynchronous calls go to one worker
    thread, started on first use.
    """

    def __init__(self, name: str):
        self.name = name
        self._exec_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._pending = 0
        self.inflight: Optional[InFlight] = None
        self._closed = False
        self._worker: Optional[threading.Thread] = None

    def run(self, fn: Callable[[], object], text: Union[str, Callable[[], str]], members: Tuple[int, ...] = (),
            watched: bool = True) -> object:
        """Run ``fn`` now, after the asynchronous calls issued before it, and return its result.

        ``members``: the world ranks the call waits for (the watchdog's departures check);
        ``watched=False``: the stall watchdog leaves the call alone (it waits by design).
        """
        if self._pending:                     # (no lock needed: this thread's earlier submits raised it)
            self.wait_pending()
        return self._execute(fn, text, members, watched)

    def wait_pending(self) -> None:
        """Wait until the asynchronous calls issued so far have run."""
        with self._cv:
            while self._pending:
                self._cv.wait()

    def submit(self, fn: Callable[[], object], text: Union[str, Callable[[], str]], members: Tuple[int, ...] = ()
               ) -> Future:
        """Queue ``fn`` for the worker thread and return a Future of its result."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("hpctrain was shut down; call hpctrain.init() again")
            self._queue.append((fn, text, fut, members))
            self._pending += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name=f"hpctrain-{self.name}", daemon=True)
                self._worker.start()
            self._cv.notify_all()
        return fut

    def _execute(self, fn, text, members=(), watched=True):
        with self._exec_lock:
            self.inflight = InFlight(text, time.monotonic(), members, watched)
            try:
                return fn()
            finally:
                self.inflight = None

    def _work(self):
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                fn, text, fut, members = self._queue.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(self._execute(fn, text, members))
                except BaseException as exc:  # delivered to the caller's wait()
                    fut.set_exception(exc)
            with self._cv:
                self._pending -= 1
                self._cv.notify_all()

    def close(self, drain: bool = True) -> None:
        """Stop the worker, after the queued calls have run when ``drain``."""
        with self._cv:
            while drain and self._pending:
                self._cv.wait()
            self._closed = True
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=5)
