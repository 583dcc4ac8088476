"""Callbacks on one event of the world's life, in one shape: ``add(callback, owner=, what=) -> remove``.

Every event hpctrain lets code follow (the world closes, a Ctrl-C ends the
job, the world re-forms, hpctrain.horovod re-initialised after a reset) is a
:class:`Hooks`: callbacks run in a stated order (registered, or last added
first), each optionally for an ``owner`` held weakly, so that an object made
per step (an optimizer, a tape) leaves no callback behind once it is dropped:
``callback(owner, *args)`` while the owner lives, taken back when it dies.

Cost: a list append per ``add``, one call per callback per event.
"""
from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Tuple

__all__ = ["Hooks"]


class Hooks:
    """The callbacks of one event, run by :meth:`run` in order (``last_first``: last added first).

    Args:
        event: what the event is, for messages ("close").
        last_first: run the callbacks last added first (as exit hooks do: what started later stops first).
    """

    def __init__(self, event: str, last_first: bool = False):
        self.event = event
        self.last_first = last_first
        self._entries: List[Tuple[str, Callable]] = []

    def add(self, callback: Callable, owner: Optional[object] = None, what: str = "") -> Callable[[], None]:
        """Run ``callback(*args)`` at each event (``callback(owner, *args)`` with an ``owner``, held weakly: once it
        is dropped the callback is taken back); ``what`` names it in messages. Returns a function that takes it
        back."""
        if owner is None:
            entry = (what, callback)
        else:
            ref = weakref.ref(owner, lambda _: remove())

            def for_owner(*args):
                held = ref()
                return None if held is None else callback(held, *args)
            entry = (what, for_owner)
        self._entries.append(entry)

        def remove() -> None:
            if entry in self._entries:
                self._entries.remove(entry)
        return remove

    def entries(self) -> List[Tuple[str, Callable]]:
        """(what, callable) of every callback now, in the order :meth:`run` calls them."""
        return list(reversed(self._entries)) if self.last_first else list(self._entries)

    def run(self, *args) -> None:
        """Call every callback with ``args``, in order; the first that raises stops the rest (it propagates)."""
        for _, callback in self.entries():
            callback(*args)

    def take_all(self) -> List[Tuple[str, Callable]]:
        """:meth:`entries`, and forget them (a world that closes runs each once)."""
        entries = self.entries()
        self._entries = []
        return entries

    def __len__(self) -> int:
        return len(self._entries)
