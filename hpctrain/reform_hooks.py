"""What follows the world when it re-forms (elastic mode): the callbacks, and how many re-formings there were.

Whatever holds the world communicator (an optimizer's buckets, a checkpoint
manager, step metrics, the timeline writer) registers here; after the
survivors made the new world (:mod:`hpctrain.elastic.reform`),
:func:`hpctrain.world` runs every callback with it, on every survivor in the
same order, so collectives inside them meet.
"""
from __future__ import annotations

import weakref
from typing import Callable

__all__ = ["on_reform", "on_reform_of", "generation", "reformed"]

_generation = [0]           # how many times the world re-formed (elastic mode) since the process started
_hooks: list = []           # callables given the new world after a re-forming


def generation() -> int:
    """How many times the world re-formed in this process (elastic mode: :mod:`hpctrain.elastic`); 0 before."""
    return _generation[0]


def on_reform(callback: Callable[[object], object]) -> Callable[[], None]:
    """Call ``callback(new_world)`` each time the world re-forms (elastic mode), on every surviving rank, in the
    order registered; return a function that takes it back.

    For whatever holds the world communicator (an optimizer's gradient
    buckets, a checkpoint manager): the old communicator is gone after a
    re-forming, so they rebuild on the new one here (collectives inside the
    callback meet: every survivor runs the same callbacks in the same order).
    """
    _hooks.append(callback)

    def remove() -> None:
        if callback in _hooks:
            _hooks.remove(callback)
    return remove


def on_reform_of(owner: object, callback: Callable[[object, object], object]) -> None:
    """:func:`on_reform` for what ``owner`` holds: ``callback(owner, new_world)``, with ``owner`` held weakly
    (once it is dropped the callback is taken back: objects made each step, a tape, leave no hook behind)."""
    def follow(world) -> None:
        held = ref()
        if held is None:
            remove()
            return
        callback(held, world)

    remove = on_reform(follow)
    ref = weakref.ref(owner, lambda _: remove())


def reformed(new) -> None:
    """Count one re-forming and run the callbacks with ``new``, the world now (called by :mod:`hpctrain.world`)."""
    _generation[0] += 1
    for hook in list(_hooks):
        hook(new)
