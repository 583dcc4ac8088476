"""How one gradient bucket is reduced: strategies found by name, compression a wrapper where it is defined.

A bucket is a flat buffer of gradients followed by two flags per tensor
(:func:`hpctrain.gradients.bucket_length`).  A strategy starts its reduction
and returns a handle whose ``wait()`` gives the reduced buffer::

    strategy(comm, flat, bucket, names, shapes, op) -> handle

* ``"allreduce"``: the whole buffer, flags included, in place (every
  communicator's default).  Cost: ``2 (N-1)/N`` x the bucket's bytes per rank
  for ring-like algorithms.
* ``"negotiated"``: hpctrain.horovod's communicator negotiates the bucket by
  its index and tensor names (:meth:`NegotiatedComm.reduce_bucket_async`).
* ``"reduce_scatter"``: ZeRO's ``N x (c + m)`` rows; ``wait()`` gives this
  rank's row (:mod:`hpctrain.torch.zero_sync`).  Cost: ``(N-1)/N`` x the rows'
  bytes.
* ``"local_sgd"``: all-reduced while ``local.synchronous`` (local SGD's
  warm-up), else kept local: nothing sent (:mod:`hpctrain.optim.local_sgd`).

A communicator says which strategy is its default (``comm.bucket_strategy``);
:func:`strategy_for` makes one by name.  :class:`Compressed` wraps the
all-reduce strategy: the gradients go through a compressor's reducer by name,
the flags all-reduced uncompressed (over a negotiated communicator both are
negotiated); a strategy that reduces its own way (ZeRO's rows, local SGD's
local steps) refuses it in one line.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Sequence

from .collectives.buckets import Bucket
from .comm.call.handle import done_handle
from .compression.reducer import Pending

__all__ = ["STRATEGIES", "strategy_for", "Compressed", "AllReduce", "Negotiated", "ReduceScatter", "LocalSGDBuckets"]


class AllReduce:
    """The whole bucket all-reduced in place, flags included (the default)."""

    name = "allreduce"
    takes_compression = True

    def __call__(self, comm, flat: Any, bucket: Bucket, names: Sequence[str], shapes: Sequence[tuple], op: str):
        return comm.allreduce_async(flat, op=op, inplace=True)


class Negotiated:
    """hpctrain.horovod's bucket: negotiated by its index and tensor names, Horovod's by name where it runs."""

    name = "negotiated"
    takes_compression = True

    def __call__(self, comm, flat: Any, bucket: Bucket, names: Sequence[str], shapes: Sequence[tuple], op: str):
        return comm.reduce_bucket_async(flat, op, bucket.index, [names[i] for i in bucket.members])


class ReduceScatter:
    """ZeRO's rows reduce-scattered: ``wait()`` gives this rank's row of reduced chunks and flags."""

    name = "reduce_scatter"
    takes_compression = False

    def __call__(self, comm, rows: Any, bucket: Bucket, names: Sequence[str], shapes: Sequence[tuple], op: str):
        return comm.reduce_scatter_async(rows, op=op)


class LocalSGDBuckets:
    """Local SGD's buckets: all-reduced during the warm-up (``local.synchronous``), kept local after it."""

    name = "local_sgd"
    takes_compression = False

    def __init__(self, local):
        self.local = local

    def __call__(self, comm, flat: Any, bucket: Bucket, names: Sequence[str], shapes: Sequence[tuple], op: str):
        if self.local.synchronous and comm.size > 1:
            return comm.allreduce_async(flat, op=op, inplace=True)
        return done_handle(flat)


STRATEGIES: Dict[str, Callable[..., Any]] = {s.name: s for s in (AllReduce, Negotiated, ReduceScatter,
                                                                  LocalSGDBuckets)}


def strategy_for(name: str, **options: Any):
    """The strategy ``name`` of :data:`STRATEGIES`, made with ``options`` (``local=`` for ``"local_sgd"``)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown bucket strategy {name!r}; expected one of {', '.join(sorted(STRATEGIES))}")
    return STRATEGIES[name](**options)


class Compressed:
    """``inner`` (an all-reduce strategy) with the bucket's gradients through ``reducer`` by name instead, the
    flags all-reduced uncompressed.  ``flat`` must be a writable float numpy array."""

    takes_compression = False

    def __init__(self, inner, reducer):
        name = getattr(inner, "name", getattr(inner, "__name__", repr(inner)))    # (a program's own: a function)
        if not getattr(inner, "takes_compression", False):
            raise ValueError(f"the {name!r} bucket strategy reduces buckets its own way: it does not take "
                             "compression (a strategy of your own says it does with takes_compression = True)")
        self.reducer = reducer      # (the inner strategy only vouches for compression: its transport is not used)
        self.name = f"compressed({name})"

    def __call__(self, comm, flat: Any, bucket: Bucket, names: Sequence[str], shapes: Sequence[tuple], op: str):
        entries = [(names[i], flat[off:off + n].reshape(shapes[i]))
                   for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels)]
        pending = self.reducer.start(entries, op=op)
        flags = comm.allreduce_async(flat[bucket.numel:], op=op, inplace=True) if comm.size > 1 else None

        def finish() -> None:
            pending.wait()
            if flags is not None:
                flags.wait()
        return Pending(finish, flat, [pending, flags])
