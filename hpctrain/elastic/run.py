"""``hpctrain.elastic.run``: run a training function, and after a failure re-form the world and run it again from
the last commit."""
from __future__ import annotations

import functools
import re
import sys
import time
from typing import Callable, List, Optional

from .. import settings
from ..errors import WorldFailedError
from .hosts import record_resets, resets_done, resume
from ..checkpoint.peer_storage import PartLost
from .reform import WorldTooSmallError, reform

__all__ = ["run", "retry", "Recovery", "reset_limit_reached", "count_resets", "end_job"]


class Recovery:
    """What an elastic API does around the one retry loop (:func:`retry`): when it starts, before each attempt,
    which exceptions are failures, and how the world and the state come back after one.

    hpctrain's own is :class:`CommitRecovery` (re-form, agree on the newest
    commit); ``hvd.elastic.run`` is the same loop with Horovod's
    (:mod:`hpctrain.horovod.elastic`: restore the last save, re-initialise the
    negotiation).  Each reset is counted by :func:`count_resets`, against
    ``HPCTRAIN_ELASTIC_RESET_LIMIT`` by :func:`reset_limit_reached`.
    """

    def start(self, state) -> None:
        """Before the first attempt (a restart on more hosts loads the commit written for it)."""

    def before_attempt(self, state) -> None:
        """Before each call of the training function."""

    def failure(self, exc: Exception) -> Optional[Exception]:
        """The failure ``exc`` stands for, which the loop recovers from; None: ``exc`` is the program's own."""
        return None

    def recover(self, state, failure: Exception) -> None:
        """Bring the world and ``state`` back after ``failure`` (or end the job, naming what was lost)."""

    def finish(self, state) -> None:
        """After the training function returned."""


def retry(func: Callable, recovery: Callable[[], Recovery]) -> Callable:
    """Wrap ``func(state, ...)``: call it, and after each failure ``recovery`` recognises, recover and call it
    again (``recovery()`` makes one :class:`Recovery` per call of the wrapper)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        how = recovery()
        how.start(state)
        while True:
            how.before_attempt(state)
            try:
                result = func(state, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the program's own errors propagate below
                failure = how.failure(exc)
                if failure is None:
                    raise
                how.recover(state, failure)
                continue
            how.finish(state)
            return result
    return wrapper


def reset_limit_reached(state, pending: int = 0) -> bool:
    """Whether the job has reset ``HPCTRAIN_ELASTIC_RESET_LIMIT`` times already, counting ``pending`` resets of
    the recovery under way (re-formings and restarts, across the launcher's restarts on more hosts)."""
    limit = settings.get("HPCTRAIN_ELASTIC_RESET_LIMIT")
    return bool(limit) and resets_done(state) + pending >= limit


def count_resets(state, count: int, world) -> None:
    """Count ``count`` more resets of ``state``'s job, and tell the launcher (rank 0 of ``world``)."""
    state._resets = getattr(state, "_resets", 0) + count
    record_resets(state, world)


def end_job(message: str) -> None:
    """End this survivor with ``message`` (status 1); every other survivor ends the same way."""
    from ..comm.life.abort import exit_after_failure

    exit_after_failure(message, 1)


def run(func: Callable) -> Callable:
    """Wrap ``func(state, ...)`` so that it survives failed ranks (elastic mode).

    The wrapper first makes every rank's ``state`` rank 0's (``state.sync()``),
    then calls ``func``.  When ranks fail, the survivors' collectives raise
    :class:`~hpctrain.errors.WorldFailedError`; the wrapper then re-forms the
    world from the survivors (:func:`hpctrain.elastic.reform`), restores the
    newest commit every survivor kept (``state.recover()``), runs the state's
    reset callbacks and calls ``func(state, ...)`` again, which goes on from
    the restored values (a loop over ``range(state.epoch, epochs)`` and a
    sampler in the state).  Steps since that commit are done again.

    A rank that fails during the recovery itself (while the world re-forms,
    in an :func:`~hpctrain.world.on_reform` callback, or while the commit is
    agreed on and broadcast) makes the survivors re-form again, until a
    recovery completes.  Fewer survivors than ``HPCTRAIN_ELASTIC_MIN_NP``
    (``--min-np``), or more re-formings than ``HPCTRAIN_ELASTIC_RESET_LIMIT``,
    end the job with a message naming what was lost.  Outside elastic mode a
    failed rank ends the job as always, and the wrapper only adds the first
    ``sync``.  ``state.recoveries`` lists what each recovery did and cost.

    With a host discovery script (``hpctrain launch --elastic
    --host-discovery-script S``) ranks on hosts that leave end at a commit and
    the others re-form as after a failure; when hosts are added, the job
    restarts on them and the wrapper first loads the commit written for that
    restart (:mod:`hpctrain.elastic.hosts`).
    """
    return retry(func, CommitRecovery)


class CommitRecovery(Recovery):
    """hpctrain's recovery: re-form the world from the survivors and go back to the newest commit all kept."""

    def start(self, state) -> None:
        from ..world import world
        from . import grow, node_resume

        state.recoveries = getattr(state, "recoveries", [])
        if grow.joining():          # (spawned onto an added host: the running world shares its state)
            grow.join(state)
            return
        resumed = resume(state) is not None     # (the launcher's restart on more hosts: a new size)
        from_node = node_resume.start(state, world(), resumed)
        if resumed or from_node is not None:
            state.on_reset()
        state.sync()
        state.drop_older_node_commits()

    def finish(self, state) -> None:
        from ..world import world
        from . import node_resume

        node_resume.finish(state, world())

    def failure(self, exc: Exception) -> Optional[Exception]:
        return exc if isinstance(exc, WorldFailedError) else wrapped_world_failure(exc)

    def recover(self, state, failure: Exception) -> None:
        from .grow import WorldGrew

        if not isinstance(failure, WorldGrew):      # (grown in place: every rank already holds the state)
            _recover(state, failure)


_FAILURE_NAMES = re.compile(r"\b(WorldFailedError|WorldFailedInHorovod)\b")


def wrapped_world_failure(exc: BaseException) -> Optional[WorldFailedError]:
    """The world's failure that a framework wrapped in its own error, or None.

    A collective inside ``tf.function`` runs as a Python op: a
    :class:`~hpctrain.errors.WorldFailedError` it raised reaches the caller
    as a ``tf.errors.OpError`` whose message names it.
    """
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(exc, tf.errors.OpError) or not _FAILURE_NAMES.search(str(exc)):
        return None
    return WorldFailedError(f"ranks failed during a TensorFlow op ({type(exc).__name__})")


def _recover(state, exc: WorldFailedError) -> None:
    """Re-form the world and bring ``state`` back to the newest common commit, again while ranks keep failing."""
    failed_at, failed_wall = time.monotonic(), time.time()
    formings: List = []          # the re-formings of this recovery (more than one when ranks fail during it)
    while True:
        if reset_limit_reached(state, len(formings)):
            end_job(f"hpctrain: {exc}; the world re-formed {settings.get('HPCTRAIN_ELASTIC_RESET_LIMIT')} times "
                    f"already (HPCTRAIN_ELASTIC_RESET_LIMIT), ending the job")
        try:
            world, info = reform()
        except WorldTooSmallError as too_few:
            end_job(str(too_few))
        except WorldFailedError as again:       # (an on_reform callback's collective met a new failure)
            formings.append(again.reformed)
            exc = again
            continue
        formings.append(info)
        t1 = time.monotonic()
        try:
            number = state.recover(world)
            what = f"commit {number}"
            state.on_reset()
        except WorldFailedError as again:
            exc = again
            continue
        except PartLost as gone:        # (a rank's part of the commit and its copy died: the disk, if it can)
            if getattr(state, "_from_disk", None) is None:
                end_job(f"{gone} ({exc})")
            try:
                step = state.from_disk()
                number, what = f"disk:{step}", f"the disk checkpoint of step {step} (a part of the commit was lost)"
                state.on_reset()
            except WorldFailedError as again:
                exc = again
                continue
            except Exception as failed:        # noqa: BLE001 - every survivor ends with the same message
                end_job(f"{gone}; the disk fallback failed too: {type(failed).__name__}: {failed}")
        t2 = time.monotonic()
        first, last = formings[0], formings[-1]
        record = {"old_size": first.old_size, "new_size": last.new_size,
                  "lost": [r for f in formings for r in f.lost], "formings": [_summary(f) for f in formings],
                  "shrink_s": sum(f.shrink_s for f in formings), "build_s": sum(f.build_s for f in formings),
                  "recover_s": t2 - t1, "reform_s": t1 - failed_at, "commit": number, "failed_at": failed_wall}
        state.recoveries.append(record)
        count_resets(state, len(formings), world)
        if world.rank == 0:
            lost = "; then ".join(f"{f.lost_text} failed" + (" during the recovery" if i else "")
                                  for i, f in enumerate(formings))
            sys.stderr.write(f"hpctrain: {lost}; the world re-formed from {first.old_size} to {last.new_size} "
                             f"ranks in {t1 - failed_at:.3f} s and went back to {what} in "
                             f"{t2 - t1:.3f} s\n")
            sys.stderr.flush()
        return


def _summary(info) -> dict:
    return {"old_size": info.old_size, "new_size": info.new_size, "lost": info.lost}
