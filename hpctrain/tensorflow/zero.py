"""ShardedOptimizer for Keras 3 (TensorFlow backend): ZeRO, each rank keeps the optimizer state of its chunks only.

``model.compile(optimizer=hpctrain.tensorflow.keras.ShardedOptimizer(keras.optimizers.AdamW(1e-3)), ...)``
replaces :func:`~hpctrain.tensorflow.keras.DistributedOptimizer`.  The layout and the
two collectives are :mod:`hpctrain.optim.zero`'s (the same as the torch adapter's):
per step the gradients are reduce-scattered in buckets (each rank receives the
average of its chunk of every bucket), a copy of the wrapped optimizer (same
class and config) updates the chunks, held in one variable per bucket, and the
chunks are all-gathered into the model's variables.  Inside ``model.fit`` each
of the two collectives is one graph op (:func:`~hpctrain.tensorflow.ops.host_call`).

Keras computes every gradient before ``apply``, so stage 2 frees no gradient
memory here (both stages shard the optimizer state; ``stage`` is accepted for
the torch adapter's sake).  The update must be element-wise (a chunk cuts
across variables): SGD, Adam, AdamW, Adamax, Adagrad, Adadelta, RMSprop, Nadam,
Lion.  A variable without a gradient gets zeros (Adam and SGD leave it as it
is; AdamW's weight decay still shrinks it), ``exclude_from_weight_decay`` does
not see the model's variable names, EMA is refused; with
``gradient_accumulation_steps=k`` each rank adds up k micro-batches' gradients
locally (whole-model buffers, as Keras does) before the reduce-scatter.  Cost per step: one reduce-scatter and one allgather per bucket
(together the bytes of one all-reduce), one copy of ``1/N`` of the variables
into the chunks.

State: ``consolidate_state_dict(to)`` then ``state_dict()`` give
``{"iterations", "slots": {slot name: [one array per variable]}}``;
``load_state_dict`` takes it at any world size.  The checkpoint manager
writes each rank's chunks instead (``shard_state_dict()``) and restores them
at any world size (``load_shard_state_dict``).
"""
from __future__ import annotations

import re
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from ..agreement import check_same
from ..collectives.buckets import plan_buckets
from ..optim.zero import SHARDS_FORMAT, Exchange, ShardLayout, layout_record, refuse_compression, reshard_copies
from .ops import host_call, swap_class

__all__ = ["ShardedOptimizer", "ELEMENTWISE"]

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Lion")
_CHUNK = re.compile(r"hpctrain_zero_chunk_(\d+)_(.+)$")


def ShardedOptimizer(optimizer: keras.optimizers.Optimizer, stage: int = 2, comm=None, bucket_mb: float = 25,
                     elementwise: Optional[bool] = None, compression=None) -> keras.optimizers.Optimizer:
    """Shard ``optimizer``'s state over the ranks of ``comm`` (ZeRO; module docstring).

    The optimizer object is returned with its class changed (as
    :func:`~hpctrain.tensorflow.keras.DistributedOptimizer`).  Wrap it before it
    is built (before ``compile``/``fit`` build it).  ``elementwise=True`` lets
    an optimizer class outside :data:`ELEMENTWISE` through; ``compression`` is refused (it is defined for
    all-reduce only).  With ``gradient_accumulation_steps=k`` the micro-batches' gradients add up locally and
    every k-th step reduce-scatters their mean.
    """
    from ..world import comm_or_world

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"ShardedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _ShardedMixin) or hasattr(optimizer, "_hpctrain"):
        raise ValueError("this optimizer is already distributed (DistributedOptimizer or ShardedOptimizer)")
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 (optimizer state sharded) or 2 (also gradients), got {stage!r}")
    if optimizer.built:
        raise ValueError("ShardedOptimizer: wrap the optimizer before it is built (before model.compile/fit "
                         "or apply_gradients use it)")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    base = type(optimizer)
    if not (base.__name__ in ELEMENTWISE if elementwise is None else elementwise):
        raise ValueError(f"ShardedOptimizer updates chunks that cut across variables, so the update must be element "
                         f"by element; {base.__name__} is not one of {ELEMENTWISE}: pass elementwise=True if it is")
    refuse_compression(compression)
    if optimizer.use_ema:
        raise ValueError("ShardedOptimizer does not take use_ema (the averages would be whole-model copies)")
    swap_class(optimizer, _ShardedMixin, "Sharded")
    optimizer._hpctrain_zero_setup = (base, comm_or_world(comm), stage, int(bucket_mb * 2 ** 20))
    optimizer._hpctrain_zero = None
    return optimizer


class _Shards:
    """The chunk variables, the inner optimizer over them, and the exchange with the other ranks."""

    def __init__(self, outer, variables, base: type, comm, cap: int):
        self.variables = list(variables)
        shapes = [(tuple(v.shape), str(v.dtype)) for v in self.variables]     # (not names: Keras numbers them per process)
        check_same(comm, "the variables given to ShardedOptimizer (shape, dtype)", shapes,
                   f"{len(shapes)} variables, first: {shapes[:3]}")
        self.buckets = plan_buckets([(int(np.prod(v.shape)), np.dtype(v.dtype).itemsize, str(v.dtype))
                                     for v in self.variables], cap)
        self.layout = ShardLayout([b.numel for b in self.buckets], comm.size, comm.rank)
        self.exchange, self.comm = Exchange(comm, self.layout, self.buckets), comm
        self.dtypes = [tf.as_dtype(b.kind) for b in self.buckets]
        self.parts = [[(i, *self.layout.own_parts(b, off, n)) for i, off, n in zip(bk.members, bk.offsets, bk.numels)]
                      for b, bk in enumerate(self.buckets)]
        self.chunks = [keras.Variable(np.zeros(self.layout.own_numel(b), dtype=bk.kind), trainable=False,
                                      name=f"hpctrain_zero_chunk_{b}") for b, bk in enumerate(self.buckets)]
        config = outer.get_config()
        config["name"] = f"{config.get('name') or 'optimizer'}_shards"
        config["gradient_accumulation_steps"] = None        # (the outer optimizer accumulates, this one updates)
        self.inner = base.from_config(config)
        self.inner.build(self.chunks)
        self.consolidated = None

    def apply(self, outer, grads, variables) -> None:
        full = [None] * len(self.variables)
        for g, v in zip(grads, variables):
            full[outer._get_variable_index(v)] = tf.convert_to_tensor(g)
        full = [tf.zeros(v.shape, v.dtype) if g is None else g for g, v in zip(full, self.variables)]
        chunk_grads = host_call(lambda *a: self.exchange.reduce_scatter(a), full, self.dtypes, "zero_reduce_scatter")
        for b, g in enumerate(chunk_grads):
            g.set_shape((self.layout.own_numel(b),))
        self.load_chunks()
        if isinstance(outer._learning_rate, keras.Variable):        # (a callback may have set a new rate)
            self.inner._learning_rate.assign(outer._learning_rate)
        self.inner.apply(chunk_grads, self.chunks)
        flats = host_call(lambda *a: self.exchange.allgather(a), [tf.convert_to_tensor(c) for c in self.chunks],
                          self.dtypes, "zero_allgather")
        for b, flat in enumerate(flats):
            bucket = self.buckets[b]
            flat.set_shape((bucket.numel,))
            for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels):
                self.variables[i].assign(tf.reshape(flat[off:off + n], self.variables[i].shape))

    def load_chunks(self) -> None:
        """Copy this rank's part of the variables into its chunks (the variables may have been loaded since)."""
        for b, parts in enumerate(self.parts):
            pieces = [tf.reshape(tf.convert_to_tensor(self.variables[i]), [-1])[plo:phi]
                      for i, lo, hi, plo, phi in parts if lo < hi]
            if pieces:
                self.chunks[b].assign(tf.concat(pieces, 0))

    def slots(self):
        """(bucket, slot name, variable) of every per-element variable of the inner optimizer."""
        for v in self.inner.variables:
            m = _CHUNK.search(v.name)
            if m:
                yield int(m.group(1)), m.group(2), v

    def consolidate(self, outer, to: Optional[int]) -> None:
        """Gather every chunk's slots into whole-variable arrays, kept on rank ``to`` (every rank for None); eager."""
        slots: dict = {}
        for b, name, v in self.slots():
            flat = self.exchange.gather(b, np.asarray(v.numpy()))
            bucket = self.buckets[b]
            per_var = slots.setdefault(name, [None] * len(self.variables))
            for i, off, n in zip(bucket.members, bucket.offsets, bucket.numels):
                per_var[i] = flat[off:off + n].reshape(tuple(self.variables[i].shape)).copy()
        keep = to is None or self.comm.rank == to
        self.consolidated = {"iterations": np.asarray(int(self.inner.iterations.numpy()), np.int64),
                             "slots": slots} if keep else None
        self.consolidated_at = int(outer.iterations.numpy())

    def shard_state(self) -> tuple:
        """``(common, own)``: the layout, slot names and step count, and this rank's chunks of every slot."""
        names = [[] for _ in self.buckets]
        own: dict = {f"b{b}": {} for b in range(len(self.buckets))}
        for b, name, v in self.slots():
            names[b].append(name)
            own[f"b{b}"][name] = np.asarray(v.numpy())
        common = {"format": SHARDS_FORMAT, "world": self.comm.size, "slots": names,
                  "iterations": np.asarray(int(self.inner.iterations.numpy()), np.int64),
                  "buckets": layout_record(self.layout, self.buckets, range(len(self.variables)))}
        return common, own

    def load_shards(self, outer, common: dict, read) -> None:
        """Take this rank's chunks from a saved sharding of any size (``read(rank)``: a saved rank's ``own``)."""
        chunks = {(b, name): np.zeros(int(np.prod(v.shape)), np.dtype(v.dtype)) for b, name, v in self.slots()}
        cache: dict = {}
        for b, lo, hi, rank, sb, slo in reshard_copies(common["buckets"], self.layout, self.buckets,
                                                       range(len(self.variables))):
            if rank not in cache:
                cache[rank] = read(rank)
            for name, src in cache[rank][f"b{sb}"].items():
                if (b, name) in chunks:
                    chunks[(b, name)][lo:hi] = np.asarray(src)[slo:slo + hi - lo]
        for b, name, v in self.slots():
            v.assign(chunks[(b, name)])
        self._set_iterations(outer, common["iterations"])

    def _set_iterations(self, outer, steps) -> None:
        steps = int(np.asarray(steps))
        self.inner.iterations.assign(steps)
        outer.iterations.assign(steps)
        self.consolidated = None

    def load(self, outer, state: dict) -> None:
        for b, name, v in self.slots():
            arrays = state["slots"][name]
            chunk = np.zeros(self.layout.own_numel(b), dtype=np.dtype(v.dtype))
            for i, lo, hi, plo, phi in self.parts[b]:
                if lo < hi:
                    chunk[lo:hi] = np.asarray(arrays[i]).reshape(-1)[plo:phi]
            v.assign(chunk)
        self._set_iterations(outer, state["iterations"])


class _ShardedMixin:
    """What a ShardedOptimizer adds to the wrapped Keras optimizer's class."""

    hpctrain_state_spans_ranks = True       # (checkpoints and elastic states take it as per-rank parts)
    _hpctrain_zero: Optional[_Shards]

    def build(self, variables):
        keras.optimizers.Optimizer.build(self, variables)       # (the base's bookkeeping; no full-size slots)
        base, comm, _, cap = self._hpctrain_zero_setup
        with tf.init_scope():       # (built at the first step, maybe while tf.function traces it: made eagerly)
            self._hpctrain_zero = _Shards(self, variables, base, comm, cap)

    def _backend_apply_gradients(self, grads, trainable_variables):
        k = self.gradient_accumulation_steps
        if not k:
            self._hpctrain_zero.apply(self, grads, trainable_variables)
            return
        sums = [self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables]

        def update():           # (every rank takes the same branch: the step count is the same everywhere)
            self._hpctrain_zero.apply(self, [(s + g) / k for s, g in zip(sums, grads)], trainable_variables)
            for s in sums:
                s.assign(tf.zeros_like(s))
            return tf.constant(True)

        def add():
            for s, g in zip(sums, grads):
                s.assign_add(g)
            return tf.constant(False)

        tf.cond((self._iterations + 1) % k == 0, update, add)

    def _zero(self) -> _Shards:
        if self._hpctrain_zero is None:
            raise RuntimeError("ShardedOptimizer: the optimizer is not built yet (it builds at its first step, or "
                               "at model.fit / optimizer.build(model.trainable_variables))")
        return self._hpctrain_zero

    @property
    def shard_comm(self):
        """The communicator whose ranks hold the chunks."""
        return self._hpctrain_zero.comm if self._hpctrain_zero is not None else self._hpctrain_zero_setup[1]

    def wait_parameters(self) -> None:
        """Nothing to wait for: the Keras step gathers the variables before it returns (the torch adapter's API)."""

    def consolidate_state_dict(self, to: Optional[int] = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` (every rank for None); collective, eager."""
        self._zero().consolidate(self, to)

    def state_dict(self) -> dict:
        """The whole state after :meth:`consolidate_state_dict` on this rank."""
        zero = self._zero()
        if zero.consolidated is None or zero.consolidated_at != int(self.iterations.numpy()):
            raise RuntimeError(f"rank {zero.comm.rank}: call optimizer.consolidate_state_dict(to=...) on every rank "
                               "after the last step, then state_dict() on the rank it was gathered to")
        return zero.consolidated

    def load_state_dict(self, state: dict) -> None:
        """Load a whole state (from :meth:`state_dict`, any world size), keeping this rank's chunks."""
        self._zero().load(self, state)

    def shard_state_dict(self) -> tuple:
        """``(common, own)``: the state as a checkpoint writes it, each rank its own chunks (no gathering)."""
        return self._zero().shard_state()

    def load_shard_state_dict(self, common: dict, read) -> None:
        """Load a state written by :meth:`shard_state_dict` at any world size (``read(rank)``: that rank's ``own``)."""
        self._zero().load_shards(self, common, read)

    def shard_bytes(self) -> int:
        """Bytes of per-element optimizer state this rank holds."""
        return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for _, _, v in self._zero().slots())
