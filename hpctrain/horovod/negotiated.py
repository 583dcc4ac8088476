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

Cost: one negotiation cycle of latency per call; calls made together ride in
the same cycle.
"""
from __future__ import annotations

from typing import Any

from . import basics

__all__ = ["NegotiatedComm"]

_COLLECTIVES = ("allreduce", "grouped_allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall",
                "barrier", "broadcast_object", "allgather_object", "shared_empty", "split")


class _Handle:
    """A Handle look-alike over a negotiated request: ``wait()`` returns the call's result."""

    def __init__(self, op):
        self._op = op

    def wait(self, timeout=None) -> Any:
        return self._op.wait()

    def test(self) -> bool:
        return self._op.done()


class NegotiatedComm:
    """The communicator of ``process_set`` with its collectives negotiated (see the module docstring)."""

    def __init__(self, process_set=None):
        self.process_set = basics.global_process_set if process_set is None else process_set
        ps = basics._set_id(self.process_set)
        self._comm = basics.controller().sets[ps][1]
        if self._comm is None:
            raise ValueError(f"this rank ({basics.rank()}) is not in {self.process_set}")

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

    def __repr__(self) -> str:
        return f"<NegotiatedComm over {self._comm!r}>"
