"""A Communicator look-alike whose collectives go through Horovod's negotiation.

hpctrain's own gradient machinery (:class:`hpctrain.torch.DistributedOptimizer`,
:class:`hpctrain.gradients.GradientAverager`) calls communicator methods in
program order.  Under ``hpctrain.horovod`` every collective must instead run
on the negotiation thread, in the order all ranks agreed on
(:mod:`hpctrain.horovod.controller`), or it could cross a Horovod request
issued meanwhile.  :class:`NegotiatedComm` forwards each collective method
as one request (kind ``call``, named by a per-process-set counter, so the
k-th call on every rank matches), and answers everything else (rank, size,
topology, ...) from the process set's communicator.  The call itself still
runs hpctrain's algorithm with its checks, so a rank that passes a different
shape still gets an error naming the ranks.

A gradient bucket (:meth:`NegotiatedComm.reduce_bucket_async`) is one such
request labelled with its tensors' names, which Horovod's timeline shows as
one ``allreduce.<parameter>`` row each, as Horovod's own optimizer does.
Where Horovod itself carries the job (``horovodrun --gloo``: hpctrain's
Horovod backend), a bucket goes to Horovod as one all-reduce named after the
optimizer and the bucket instead: Horovod negotiates by name (in any order,
fused with what else is ready) and caches the negotiation of a name it saw
before, so a negotiation of hpctrain.horovod's own on top would only add a
Horovod operation per bucket.

Cost: one negotiation cycle of latency per call; calls made together ride in
the same cycle.  A direct bucket: one Horovod operation.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import numpy as np

from ..waiting import wait_until
from . import basics

__all__ = ["NegotiatedComm"]

_COLLECTIVES = ("allreduce", "grouped_allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall",
                "barrier", "broadcast_object", "allgather_object", "shared_empty", "split")
_DIRECT_DTYPES = ("float32", "float64")
_IDS = itertools.count()          # NegotiatedComms in creation order: the same on every rank


class _Handle:
    """A :class:`~hpctrain.comm.call.handle.Waitable` over a negotiated request: ``wait()`` returns the call's result."""

    def __init__(self, op):
        self._op = op

    def wait(self, timeout=None) -> Any:
        return self._op.wait(timeout)

    def test(self) -> bool:
        return self._op.done()


class _Direct:
    """A :class:`~hpctrain.comm.call.handle.Waitable` over a bucket Horovod reduces by name: ``wait()`` returns it."""

    def __init__(self, reduction, out, rows, started: float):
        self._reduction, self._out, self._rows, self._started = reduction, out, rows, started

    def wait(self, timeout=None) -> Any:
        if self._rows is not None:
            wait_until(self.test, timeout, "the bucket's reduction")
            self._reduction.wait()
            ctl = basics.controller()
            if ctl.timeline is not None:
                ctl.timeline.direct(self._rows, self._started, time.time())
            self._rows = None
        return self._out

    def test(self) -> bool:
        return self._reduction.test()


def _host_view(x) -> Any:
    """A writable C-contiguous numpy array sharing ``x``'s memory (numpy, CPU torch tensor), else None."""
    if type(x) is np.ndarray:
        return x if x.flags.c_contiguous and x.flags.writeable else None
    if type(x).__module__.startswith("torch") and getattr(x, "device", None) is not None:
        if x.device.type == "cpu" and x.is_contiguous() and not x.requires_grad:
            return x.numpy()
    return None


class NegotiatedComm:
    """The communicator of ``process_set`` with its collectives negotiated (see the module docstring)."""

    bucket_strategy = "negotiated"      # gradient buckets by index and names (hpctrain.bucket_strategies)

    def __init__(self, process_set=None):
        self.process_set = basics.global_process_set if process_set is None else process_set
        ps = basics._set_id(self.process_set)
        self._comm = basics.controller().sets[ps][1]
        if self._comm is None:
            raise ValueError(f"this rank ({basics.rank()}) is not in {self.process_set}")
        self._id = next(_IDS)

    def __getattr__(self, attr: str) -> Any:
        base = attr[:-6] if attr.endswith("_async") else attr
        if base not in _COLLECTIVES:
            return getattr(self._comm, attr)

        def call(*args, **kwargs):
            op = basics.submit("call", None, self.process_set, (attr,),
                               lambda comm: getattr(comm, base)(*args, **kwargs))
            return _Handle(op) if attr != base else op.wait()
        call.__name__ = attr
        return call

    @property
    def timeline(self):
        """The world's timeline (what the features record, beside the negotiated calls' rows)."""
        return self._comm.timeline

    @property
    def topology(self):
        """The node layout of the process set's communicator."""
        return self._comm.topology

    @property
    def life(self):
        """The world's life (:class:`~hpctrain.comm.life.world_life.WorldLife`)."""
        return self._comm.life

    def on_close(self, callback, what: str, owner=None):
        """Run ``callback`` when the world closes (:meth:`Communicator.on_close`)."""
        return self._comm.on_close(callback, what, owner)

    def reduce_bucket_async(self, flat: Any, op: str, index: int, tensors: Sequence[str]):
        """All-reduce gradient bucket ``index`` (``flat``, in place) holding ``tensors``; ``wait()`` returns it.

        Negotiated as a ``call`` labelled ``allreduce.<name>`` per tensor (the
        timeline's rows); where Horovod carries the job, a float32/float64 sum
        or average goes to Horovod by name (module docstring).  A rank that
        joins (``hvd.join()``) takes no part in those: the others' waits end
        with an error naming it, which the negotiation tells them.
        """
        rows = tuple(t if t.startswith("allreduce.") else f"allreduce.{t}" for t in tensors)
        arr = _host_view(flat)
        direct = self._comm.named_allreduce_async     # (Horovod's named all-reduce; None on other backends)
        if direct is not None and arr is not None and arr.dtype.name in _DIRECT_DTYPES and op in ("sum", "avg"):
            ctl = basics.controller()
            name = f"hpctrain.horovod.grads.{self._id}.{basics._set_id(self.process_set)}.{index}"
            return _Direct(direct(arr.reshape(-1), name, op, ctl.direct_failure), flat, rows, time.time())
        request = basics.submit("call", None, self.process_set, ("allreduce_async",),
                                lambda comm: comm.allreduce(flat, op=op, inplace=True),
                                labels=tuple((row, "allreduce") for row in rows))
        return _Handle(request)

    def adasum_allreduce(self, flat: np.ndarray, segments: Sequence[int]) -> np.ndarray:
        """The Adasum of every rank's ``flat`` (tensors of ``segments`` lengths), as one negotiated call."""
        from ..collectives.adasum import adasum_allreduce
        return basics.submit("call", None, self.process_set, ("adasum_allreduce",),
                             lambda comm: adasum_allreduce(comm, flat, segments)).wait()

    def __repr__(self) -> str:
        return f"<NegotiatedComm over {self._comm!r}>"
