"""What follows the world when it re-forms (elastic mode): the callbacks, and how many re-formings there were.

Whatever holds the world communicator (an optimizer's buckets, a checkpoint
manager, step metrics, the timeline writer) registers here; after the
survivors made the new world (:mod:`hpctrain.elastic.reform`),
:func:`hpctrain.world` runs every callback with it, on every survivor in the
same order, so collectives inside them meet.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..hooks import Hooks

__all__ = ["on_reform", "on_reform_of", "generation", "reformed"]

_generation = [0]           # how many times the world re-formed (elastic mode) since the process started
_hooks = Hooks("re-form")   # callables given the new world after a re-forming


def generation() -> int:
    """How many times the world re-formed in this process (elastic mode: :mod:`hpctrain.elastic`); 0 before."""
    return _generation[0]


def on_reform(callback: Callable[..., object], owner: Optional[object] = None) -> Callable[[], None]:
    """Call ``callback(new_world)`` each time the world re-forms (elastic mode), on every surviving rank, in the
    order registered; return a function that takes it back.

    For whatever holds the world communicator (an optimizer's gradient
    buckets, a checkpoint manager): the old communicator is gone after a
    re-forming, so they rebuild on the new one here (collectives inside the
    callback meet: every survivor runs the same callbacks in the same order).
    With an ``owner``, held weakly, it is ``callback(owner, new_world)`` until
    the owner is dropped (objects made each step, a tape, leave no hook behind).
    """
    return _hooks.add(callback, owner)


def on_reform_of(owner: object, callback: Callable[[object, object], object]) -> None:
    """:func:`on_reform` for what ``owner`` holds: ``callback(owner, new_world)``, with ``owner`` held weakly."""
    on_reform(callback, owner)


def reformed(new) -> None:
    """Count one re-forming and run the callbacks with ``new``, the world now (called by :mod:`hpctrain.world`)."""
    _generation[0] += 1
    _hooks.run(new)
