"""What a world does when ranks fail: the one object that says it (abort, re-form, or go on with a handler).

The runtime asks its policy to guard each collective and at each watchdog
period; the exception hook (:mod:`hpctrain.world`), ``python -m
hpctrain.run`` and hpctrain.horovod's negotiation ask it what an uncaught
exception or a failed request does.  ``HPCTRAIN_ELASTIC`` is read once, where
the runtime picks its policy (:func:`policy_for`); nothing else branches on it.

* :class:`Abort` (the default): a failed rank ends the job, naming it and its
  node; an uncaught exception aborts every rank.
* :class:`Reform` (elastic mode): the first survivor to learn of a failure
  revokes every communicator of the world (:meth:`Reform.on_revoke`), so that
  every collective in flight ends with :class:`~hpctrain.errors.WorldFailedError`
  instead of waiting; :func:`hpctrain.elastic.run` then re-forms the world
  from the survivors.  An uncaught exception ends only its own process,
  which the others see as a failed rank.
* :class:`Tolerate` (:meth:`Communicator.on_rank_failure`): the program's
  handler is told every failed world rank known, each time more are, and the
  job goes on (what goes on talks point to point: a parameter server); at
  shutdown those ranks are not waited for.  It stands in for the policy it
  replaced, which comes back when the handler is taken back.

Cost: none per collective outside elastic mode; in elastic mode one
``try``/``except`` around each and one flag test.
"""
from __future__ import annotations

from typing import Callable, List, Optional

from ...errors import WorldFailedError
from .abort import fail_this_rank

__all__ = ["FailurePolicy", "Abort", "Reform", "Tolerate", "policy_for"]


class FailurePolicy:
    """What failed ranks do to this world (module docstring); ``rt`` is the world's runtime."""

    reforms = False             # whether the world re-forms from the survivors (elastic mode)
    polls_requests = False      # whether waits on MPI requests poll, so a failed peer ends them (elastic mode)
    planned_leave = False       # ranks leave by the launcher's plan (hosts removed), not by a fault (set per world)

    def __init__(self, rt):
        self.rt = rt

    @property
    def failed(self) -> List[int]:
        """World ranks this world knows failed (elastic mode: once it was revoked; [-1]: some rank)."""
        return []

    @property
    def left_behind(self) -> List[int]:
        """Failed world ranks the job went on without (a handler's): they are not waited for at shutdown."""
        return []

    def guard(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn``, a collective, as the lane runs it."""
        return fn

    def on_revoke(self, revoke: Callable[[], None]) -> Callable[[], None]:
        """Have ``revoke`` (one communicator's revocation) run when ranks fail; return a remover."""
        return lambda: None

    def watch(self) -> None:
        """One watchdog period: a failure known ends the job, naming the failed ranks."""
        failed = self.rt.failure_message() if not self.rt.closed else ""
        if failed:
            self.rt.exit_after_failure(failed)

    def world_error(self, exc: BaseException) -> Optional[WorldFailedError]:
        """The error to raise for ``exc`` when it means ranks failed and the world re-forms, else None."""
        return None

    def end_after(self, rank: int, text: str, where: str, exc: BaseException, status: int = 1) -> None:
        """End after an uncaught ``exc`` (its traceback ``text``; ``where``: " in script.py" or ""); never returns.

        A failure known is said and ends this process (the others end the
        same way); else the whole job is aborted with ``status``.
        """
        self._after_failure(where, exc)
        self.rt.abort(f"hpctrain: rank {rank}: uncaught exception{where}, aborting the job:\n{text}", status)

    def at_close(self) -> List[int]:
        """The failed ranks that shutdown does not wait for."""
        return []

    def fail_alone(self, rank: int, message: str) -> None:
        """End only this process, as a failed rank the others re-form without, where the world re-forms and no
        failure is known yet (never returns then); else return."""

    def _after_failure(self, where: str, exc: BaseException) -> None:
        failed = self.rt.failure_message()      # (an MPI call that failed because ranks died: name them)
        if failed:
            self.rt.exit_after_failure(f"{failed}\n(the exception{where}: {type(exc).__name__}: {exc})")


class Abort(FailurePolicy):
    """A failed rank ends the job (the default)."""


class Reform(FailurePolicy):
    """Elastic mode: failures revoke the world and raise; the survivors re-form (module docstring)."""

    reforms = True
    polls_requests = True

    def __init__(self, rt):
        super().__init__(rt)
        self.revokers: List[Callable[[], None]] = []    # each communicator's revocation
        self._failed: List[int] = []                    # world ranks known failed, once world_failed ran

    @property
    def failed(self) -> List[int]:
        return self._failed

    def guard(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` that raises WorldFailedError once ranks failed, or when it failed because they did."""
        def guarded():
            if self._failed:
                raise self.error()
            try:
                return fn()
            except Exception as exc:
                if not self._failed and not self.rt.is_failure(exc):
                    detector = self.rt.failures           # (a revoked or broken call also ends in other errors)
                    if detector is None or not detector.failed():
                        raise
                # (what is known now: reform() waits for a lost node's other processes to be reported)
                self.world_failed(self.rt.failures.failed() if self.rt.failures is not None else [])
                raise self.error() from exc
        return guarded

    def on_revoke(self, revoke: Callable[[], None]) -> Callable[[], None]:
        self.revokers.append(revoke)
        return lambda: revoke in self.revokers and self.revokers.remove(revoke)

    def watch(self) -> None:
        """A failure is the survivors' to handle (their collectives raise): learn of it, revoke the world."""
        if not self.rt.closed:
            self.failure_known()

    def world_failed(self, ranks) -> None:
        """Ranks failed: remember them and revoke every communicator, once, so that every survivor's collective
        in flight ends (with WorldFailedError) instead of waiting for them."""
        if self._failed:
            return
        self._failed = sorted(ranks) or [-1]
        for revoke in list(self.revokers):
            try:
                revoke()
            except Exception:  # noqa: BLE001 - one communicator that cannot be revoked must not stop the others
                pass

    def failure_known(self) -> bool:
        """Whether a rank failed; the first to learn it revokes the world (as the watchdog would)."""
        if not self._failed and self.rt.failures is not None:
            known = self.rt.failures.failed()
            if known:
                self.world_failed(known)
        return bool(self._failed)

    def error(self) -> WorldFailedError:
        """The WorldFailedError naming the failed ranks known."""
        known = [r for r in self._failed if r >= 0]
        detector = self.rt.failures
        said = detector.describe(known) if known and detector is not None else "a rank"
        return WorldFailedError(f"hpctrain: rank {self.rt.world_rank}: {said} failed (the process died or its node "
                                f"was lost); the world must re-form (hpctrain.elastic.run does)", known)

    def world_error(self, exc: BaseException) -> Optional[WorldFailedError]:
        if isinstance(exc, WorldFailedError):
            return exc
        if not self.rt.is_failure(exc):
            return None
        self.world_failed(self.rt.failures.failed() if self.rt.failures is not None else [])
        return self.error()

    def end_after(self, rank: int, text: str, where: str, exc: BaseException, status: int = 1) -> None:
        """A failure known ends this process; else it fails alone and the others re-form without it."""
        self._after_failure(where, exc)
        self.fail_alone(rank, f"hpctrain: rank {rank}: uncaught exception{where}:\n{text}")
        super().end_after(rank, text, where, exc, status)

    def fail_alone(self, rank: int, message: str) -> None:
        if not self._failed:
            fail_this_rank(message, rank)


class Tolerate(FailurePolicy):
    """Go on when ranks fail: ``handler(failed world ranks)`` stands in for ``previous``'s abort or re-forming."""


    def __init__(self, rt, handler: Callable[[List[int]], None], previous: FailurePolicy):
        super().__init__(rt)
        self.handler, self.previous = handler, previous
        self.reforms = previous.reforms
        self.tolerated: List[int] = []      # what the handler was last told

    @property
    def failed(self) -> List[int]:
        return self.previous.failed

    @property
    def left_behind(self) -> List[int]:
        return self.tolerated

    def guard(self, fn: Callable[[], object]) -> Callable[[], object]:
        return self.previous.guard(fn)

    def on_revoke(self, revoke: Callable[[], None]) -> Callable[[], None]:
        return self.previous.on_revoke(revoke)

    def watch(self) -> None:
        """Tell the handler every failed rank known, each time more are."""
        detector = self.rt.failures
        known = detector.failed() if detector is not None and not self.rt.closed else []
        if len(known) > len(self.tolerated):
            self.tolerated = known
            self.handler(known)

    def world_error(self, exc: BaseException) -> Optional[WorldFailedError]:
        return self.previous.world_error(exc)

    def end_after(self, rank: int, text: str, where: str, exc: BaseException, status: int = 1) -> None:
        self.previous.end_after(rank, text, where, exc, status)

    def fail_alone(self, rank: int, message: str) -> None:
        self.previous.fail_alone(rank, message)

    def at_close(self) -> List[int]:
        if self.rt.failures is not None:
            self.tolerated = self.rt.failures.failed()
        return self.tolerated


def policy_for(rt) -> FailurePolicy:
    """The policy a new world starts with: :class:`Reform` in elastic mode (``HPCTRAIN_ELASTIC``), else
    :class:`Abort`."""
    return Reform(rt) if rt.config.elastic else Abort(rt)
