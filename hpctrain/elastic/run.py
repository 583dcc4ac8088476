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
from .peer_copy import PartLost
from .reform import WorldTooSmallError, reform

__all__ = ["run"]


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
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if resume(state) is not None:     # (the launcher's restart on more hosts: a new size)
            state.on_reset()
        state.sync()
        state.recoveries = getattr(state, "recoveries", [])
        while True:
            try:
                return func(state, *args, **kwargs)
            except WorldFailedError as exc:
                _recover(state, exc)
            except Exception as exc:        # (a failure inside tf.function reaches here as TensorFlow's error)
                failure = wrapped_world_failure(exc)
                if failure is None:
                    raise
                _recover(state, failure)
    return wrapper


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
    limit = settings.get("HPCTRAIN_ELASTIC_RESET_LIMIT")
    formings: List = []          # the re-formings of this recovery (more than one when ranks fail during it)
    while True:
        done = resets_done(state) + len(formings)
        if limit and done >= limit:
            _end(f"hpctrain: {exc}; the world re-formed {limit} times already "
                 f"(HPCTRAIN_ELASTIC_RESET_LIMIT), ending the job")
        try:
            world, info = reform()
        except WorldTooSmallError as too_few:
            _end(str(too_few))
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
                _end(f"{gone} ({exc})")
            try:
                step = state.from_disk()
                number, what = f"disk:{step}", f"the disk checkpoint of step {step} (a part of the commit was lost)"
                state.on_reset()
            except WorldFailedError as again:
                exc = again
                continue
            except Exception as failed:        # noqa: BLE001 - every survivor ends with the same message
                _end(f"{gone}; the disk fallback failed too: {type(failed).__name__}: {failed}")
        t2 = time.monotonic()
        first, last = formings[0], formings[-1]
        record = {"old_size": first.old_size, "new_size": last.new_size,
                  "lost": [r for f in formings for r in f.lost], "formings": [_summary(f) for f in formings],
                  "shrink_s": sum(f.shrink_s for f in formings), "build_s": sum(f.build_s for f in formings),
                  "recover_s": t2 - t1, "reform_s": t1 - failed_at, "commit": number, "failed_at": failed_wall}
        state.recoveries.append(record)
        state._resets = getattr(state, "_resets", 0) + len(formings)
        record_resets(state, world)
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


def _end(message: str) -> None:
    """End this survivor with ``message`` (status 1); every other survivor ends the same way."""
    from ..comm.abort import exit_after_failure

    exit_after_failure(message, 1)
