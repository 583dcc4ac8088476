"""The world's life as the features above the communicator see it: one object every communicator holds.

``comm.life`` (:class:`WorldLife`) is the seam between the features (elastic
re-forming, hpctrain.horovod's negotiation, the parameter server, the
exception hook) and the world's runtime (:mod:`hpctrain.comm.life.runtime`): the
failure policy to ask, the ranks that failed or left, ending this process
after a failure, who may issue collectives, the close and interrupt hooks.
The communicator's own public methods (``on_close``, ``on_interrupt``,
``on_rank_failure``, ``abort``) are the program's part of the same life.

Cost: none per collective; each method is one call into the runtime.
"""
from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence

from ...hooks import Hooks
from .failure_policy import FailurePolicy, Tolerate

__all__ = ["WorldLife"]


class WorldLife:
    """The life of the world ``runtime`` belongs to (module docstring); every communicator over it shares it."""

    def __init__(self, runtime):
        self._rt = runtime

    @property
    def failure_policy(self) -> FailurePolicy:
        """What failed ranks do to this world (:mod:`hpctrain.comm.life.failure_policy`): ask it, not the settings."""
        return self._rt.policy

    @property
    def failure_detector(self):
        """The backend's detector of failed ranks (``failed()``, ``settled()``, ``describe()``), or None."""
        return self._rt.failures

    def failure_message(self) -> str:
        """Say which world ranks failed and on which nodes ("" if none is known)."""
        return self._rt.failure_message()

    def exit_after_failure(self, message: str, code: int = 1) -> None:
        """End this process after ranks failed, telling the others it leaves (never returns)."""
        self._rt.exit_after_failure(message, code)

    def tolerate(self, handler: Callable[..., None], owner: Optional[object] = None) -> Callable[[], None]:
        """Put the :class:`~hpctrain.comm.life.failure_policy.Tolerate` policy with ``handler`` in place of the
        current one (:meth:`Communicator.on_rank_failure`); return a function that restores it.  With an
        ``owner``, held weakly, it is ``handler(owner, failed)``, and the policy before comes back once the
        owner is dropped (:class:`~hpctrain.hooks.Hooks`' shape)."""
        rt, hooks = self._rt, Hooks("rank failure")
        hooks.add(handler, owner)
        tolerate = rt.policy = Tolerate(rt, hooks.run, rt.policy)

        def remove() -> None:
            if rt.policy is tolerate:
                rt.policy = tolerate.previous
        if owner is not None:
            weakref.finalize(owner, remove)
        return remove

    def reserve_collectives(self, thread) -> None:
        """Let only ``thread`` issue collectives from now on (None: any thread again; hpctrain.horovod's
        negotiation thread)."""
        self._rt.owner = thread

    def discard(self) -> None:
        """Stop this world's runtime on this rank without leaving (elastic mode: the world re-forms)."""
        self._rt.discard()

    def departed(self, among: Sequence[int]) -> str:
        """Say which of the world ranks ``among`` have left the job (returned, exited, shut down), as the
        watchdog would name them; "" if none has."""
        board = self._rt.departures
        if board is None:
            return ""
        among = set(among)
        left = [r for r in board.update() if r in among]
        return board.describe(left) if left else ""

    def left_while_waiting(self, among: Sequence[int], since: float, now: float) -> str:
        """Say which of the world ranks ``among`` left the job since ``since`` (``time.monotonic()``) while this
        rank waited for them (as the watchdog names them); "" if none did."""
        board = self._rt.departures
        if board is None:
            return ""
        board.update()
        gone = board.blocking(among, since, now)
        return board.describe(gone) if gone else ""

    def on_close(self, callback: Callable[..., object], what: str, owner: Optional[object] = None
                 ) -> Callable[[], None]:
        """Run ``callback`` when the world closes, before its lanes stop; return a function that takes it back
        (:meth:`Communicator.on_close`).

        ``what`` names it in the error when it fails ("the timeline writer").
        Callbacks run last added first (as exit hooks do: what started later
        stops first), the same on every rank, so callbacks that call
        collectives meet.  With an ``owner`` (held weakly) it is
        ``callback(owner)`` (:class:`~hpctrain.hooks.Hooks`).
        """
        return self._rt.close_hooks.add(callback, owner, what)

    def on_interrupt(self, describe: Callable[..., str], owner: Optional[object] = None) -> Callable[[], None]:
        """:meth:`Communicator.on_interrupt`."""
        return self._rt.interrupt_hooks.add(describe, owner)

    def interrupt_notes(self) -> List[Callable[[], str]]:
        """The ``on_interrupt`` callbacks registered now (rank 0 calls them once the interruption is handled)."""
        return [describe for _, describe in self._rt.interrupt_hooks.entries()]
