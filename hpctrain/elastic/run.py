"""``hpctrain.elastic.run``: run a training function, and after a failure re-form the world and run it again from
the last commit."""
from __future__ import annotations

import functools
import sys
import time
from typing import Callable

from .. import settings
from ..errors import WorldFailedError
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

    Fewer survivors than ``HPCTRAIN_ELASTIC_MIN_NP`` (``--min-np``), or more
    re-formings than ``HPCTRAIN_ELASTIC_RESET_LIMIT``, end the job with a
    message naming what was lost.  Outside elastic mode a failed rank ends the
    job as always, and the wrapper only adds the first ``sync``.
    ``state.recoveries`` lists what each re-forming did and cost.
    """
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        state.recoveries = getattr(state, "recoveries", [])
        limit = settings.get("HPCTRAIN_ELASTIC_RESET_LIMIT")
        while True:
            try:
                return func(state, *args, **kwargs)
            except WorldFailedError as exc:
                failed_at, failed_wall = time.monotonic(), time.time()
                if limit and len(state.recoveries) >= limit:
                    _end(f"hpctrain: {exc}; the world re-formed {limit} times already "
                         f"(HPCTRAIN_ELASTIC_RESET_LIMIT), ending the job")
                try:
                    world, info = reform()
                except WorldTooSmallError as too_few:
                    _end(str(too_few))
                t1 = time.monotonic()
                number = state.recover(world)
                t2 = time.monotonic()
                state.on_reset()
                record = {"old_size": info.old_size, "new_size": info.new_size, "lost": info.lost,
                          "shrink_s": info.shrink_s, "build_s": info.build_s, "recover_s": t2 - t1,
                          "reform_s": t1 - failed_at, "commit": number, "failed_at": failed_wall}
                state.recoveries.append(record)
                if world.rank == 0:
                    sys.stderr.write(f"hpctrain: {info.lost_text} failed; the world re-formed from "
                                     f"{info.old_size} to {info.new_size} ranks in {t1 - failed_at:.3f} s and "
                                     f"went back to commit {number} in {t2 - t1:.3f} s\n")
                    sys.stderr.flush()
    return wrapper


def _end(message: str) -> None:
    """End this survivor with ``message`` (status 1); every other survivor ends the same way."""
    from ..comm.abort import exit_after_failure

    exit_after_failure(message, 1)
