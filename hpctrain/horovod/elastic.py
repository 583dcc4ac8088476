"""``hvd.elastic``: Horovod's elastic API (``run``, ``State``, ``ObjectState``) on hpctrain's elastic mode.

Start the job with ``hpctrain launch --elastic -n N train.py`` (not
``horovodrun``): when ranks die, every survivor's pending Horovod request fails
with ``HorovodInternalError`` (the negotiation stops; hpctrain's runtime
revoked the world), and :func:`run` then does what Horovod's does: the state
goes back to its last commit (``state.restore()``), Horovod is reset, the reset
callbacks run, rank 0's state is broadcast (``state.sync()``) and the training
function is called again.  Horovod's reset re-forms the world from the
survivors here (:func:`hpctrain.elastic.reform`: ``MPI_Comm_shrink``) and
starts the negotiation on it; what holds the old negotiation (a
``DistributedOptimizer``'s buckets) rebuilds through
:func:`hpctrain.horovod.basics.on_reset`.

What differs from Horovod: the survivors keep their processes (no new
rendezvous of restarted workers), a failed rank's healthy neighbours on its
host stay in the job (Horovod leaves out the whole host), and hosts added by
the discovery script join through a restart of the job from the commit
(written to the launcher's folder; :mod:`hpctrain.elastic.hosts`), where
Horovod starts workers on them beside the running ones.  A commit keeps one copy per rank in
host memory (the last two; a restore goes back to the newest).
"""
from __future__ import annotations

import queue
from typing import Any, Optional

from .. import settings
from ..elastic import hosts
from ..elastic.hosts import resume, resuming
from ..elastic.run import Recovery, count_resets, end_job, reset_limit_reached, retry, wrapped_world_failure
from ..elastic.state import ObjectState as _CoreObjectState
from ..world import world
from . import basics
from .basics import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["run", "State", "ObjectState"]


def run(func):
    """Horovod's decorator: run ``func(state, ...)`` again after each reset (failed ranks, changed hosts).

    ``state.sync()`` first; on ``HorovodInternalError`` the state is restored
    to its last commit; on ``HostsUpdatedInterrupt`` it is kept (and synced
    again unless the interrupt says ``skip_sync``).  More resets than
    ``HPCTRAIN_ELASTIC_RESET_LIMIT`` (Horovod's ``--reset-limit``) end the job.
    It is :func:`hpctrain.elastic.run`'s loop and reset count with Horovod's
    recovery (:class:`HorovodRecovery`).
    """
    return retry(func, HorovodRecovery)


class HorovodRecovery(Recovery):
    """Horovod's recovery: restore the last save (or keep the state after a change of hosts), stop the
    negotiation, re-form the world if ranks failed, start the negotiation again."""

    def __init__(self):
        self.skip_sync = False

    def start(self, state) -> None:
        if resuming():          # (the launcher's restart on more hosts: load the commit written for it)
            basics.shutdown()
            resume(state)
            _reset()
            state.on_reset()

    def before_attempt(self, state) -> None:
        if not self.skip_sync:
            state.sync()

    def failure(self, exc: Exception) -> Optional[Exception]:
        if isinstance(exc, (HorovodInternalError, HostsUpdatedInterrupt)) or wrapped_world_failure(exc) is not None:
            return exc          # (a failure inside tf.function reaches here as TensorFlow's error)
        return None

    def recover(self, state, failure: Exception) -> None:
        if isinstance(failure, HostsUpdatedInterrupt):
            self.skip_sync = failure.skip_sync
        else:
            state.restore()
            self.skip_sync = False
        if reset_limit_reached(state):
            end_job(f"hpctrain.horovod: {failure}; reset {settings.get('HPCTRAIN_ELASTIC_RESET_LIMIT')} time(s) "
                    f"already (HPCTRAIN_ELASTIC_RESET_LIMIT), ending the job")
        _reset()
        count_resets(state, 1, world())
        state.on_reset()


def _reset() -> None:
    """Horovod's reset: stop the negotiation, re-form the world if ranks failed, start the negotiation again
    (and again, while ranks keep failing during it)."""
    from ..elastic.reform import WorldTooSmallError, reform
    from ..errors import WorldFailedError

    while True:
        basics.shutdown()
        try:
            if world().life.failure_policy.failed:
                reform()
            basics.init()
            basics.reset_hooks.run()
            return
        except WorldTooSmallError as exc:
            end_job(str(exc))
        except WorldFailedError:        # (a rank failed during the reset: the new world re-forms too)
            continue


class State(_CoreObjectState):
    """Horovod's elastic ``State``: ``commit()`` = ``save()`` + ``check_host_updates()``; ``restore()`` goes back
    to the last save; ``sync()`` gives every rank rank 0's state (through Horovod's broadcasts)."""

    grows_in_place = False      # (added hosts restart the job: Horovod's reset re-initialises on all ranks)

    def __init__(self, **values: Any):
        self._track_hosts()
        super().__init__(**values)

    def _track_hosts(self) -> None:
        """Horovod's host-change queue and the time of the newest change seen (before the first commit)."""
        self._host_messages: queue.Queue = _HostMessages()
        self._last_updated_timestamp = 0

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt when hosts changed (collective with a discovery script).

        With ``hpctrain launch --elastic --host-discovery-script S``: ranks on
        hosts that left end here and the others raise the interrupt (with
        ``skip_sync``: they re-form without them); hosts added restart the job
        on them from this commit (:mod:`hpctrain.elastic.hosts`).  Changes
        given to ``on_hosts_updated`` raise it too.
        """
        if hosts.check(self):
            self._host_messages = _HostMessages()
            raise HostsUpdatedInterrupt(True)
        newest, removed_only = self._last_updated_timestamp, True
        while self._host_messages.qsize():
            timestamp, update = self._host_messages.get()
            if timestamp > newest:
                newest, removed_only = timestamp, removed_only and update == "removed"
        if newest > self._last_updated_timestamp:
            self._last_updated_timestamp = newest
            raise HostsUpdatedInterrupt(removed_only)

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Horovod's driver callback: hosts changed at ``timestamp`` (``update_res``: "added"/"removed"/...)."""
        self._host_messages.put((timestamp, update_res))

    def on_reset(self) -> None:
        self._host_messages = _HostMessages()
        super().on_reset()

    def sync(self, comm=None) -> None:
        """Give every rank rank 0's state, then save it (collective, through Horovod's broadcasts)."""
        self._sync(None)
        self.save()

    def broadcast_value(self, comm, value: Any) -> Any:
        from .requests import broadcast_object

        return broadcast_object(value, 0, None, basics.global_process_set)

    def release_world(self) -> None:
        basics.shutdown()       # (the job ends for a restart: hpctrain's checkpoint collectives write the commit)

    def allgather_value(self, comm, value: Any) -> list:
        from .requests import allgather_object

        return allgather_object(value, None, basics.global_process_set)


class _HostMessages(queue.Queue):
    """Horovod's queue of host changes; not ``empty()`` either while the elastic launcher has hosts news this
    job has not acted on (what a training loop polls for between commits)."""

    def empty(self) -> bool:
        reader = hosts.news()
        return super().empty() and (reader is None or reader.pending() is None)


class ObjectState(State):
    """Horovod's ``ObjectState``: named values as attributes, saved as copies and broadcast from rank 0.

    Horovod's first two arguments (``bcast_object``, ``get_rank``) are
    accepted and unused: Horovod's broadcast is used.
    """

    def __init__(self, bcast_object=None, get_rank=None, **values: Any):
        super().__init__(**values)


_ELSEWHERE = {"TorchState": "hpctrain.horovod.torch", "ElasticSampler": "hpctrain.horovod.torch",
              "TensorFlowKerasState": "hpctrain.horovod.tensorflow", "KerasState": "hpctrain.horovod.keras"}


def __getattr__(name: str):
    if name in _ELSEWHERE:
        raise AttributeError(f"hvd.elastic.{name} is in the elastic module of {_ELSEWHERE[name]} "
                             f"(import {_ELSEWHERE[name]} as hvd; hvd.elastic.{name})")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
