"""TensorFlow collectives on hpctrain's core, eagerly or inside ``tf.function``.

Eagerly, a collective converts its tensors to numpy (one copy each way) and
calls the communicator.  Inside ``tf.function`` the same Python code becomes one
graph op through ``tf.numpy_function`` (stateful, so TensorFlow keeps it in
program order and never prunes or reorders it): every rank traces the same
graph, so every rank issues the same collectives in the same order.  Cost per
call: the tensors go to host memory and back (free for CPU tensors, one
device-host copy each way on a GPU) and the Python call holds the GIL while
the collective runs, and holds one of TensorFlow's inter-op threads while it
waits for the other ranks.  Inside ``tf.function`` that is harmless (program
order); in a TF1 session, independent collectives run concurrently, and if
every inter-op thread of one rank waits in a collective that another rank
has not reached because its own threads wait in others, no rank goes on.  So
that the pool has room, importing this module sets ``TF_NUM_INTEROP_THREADS``
(read when TensorFlow creates its pools, at the first session or eager op)
to 64 (the core count where larger) unless it is set.  XLA cannot compile a
Python call: with ``jit_compile=True`` the collectives raise an error that
says so.
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ..agreement import check_same
from ..compression import Policy
from ..gradients import GradientAverager
from ..metrics import average_metrics
from ..world import comm_or_world

# Threads for collectives that block in a TF1 session (see the module docstring): one per concurrent collective.
BLOCKING_ROOM = 64
os.environ.setdefault("TF_NUM_INTEROP_THREADS", str(max(BLOCKING_ROOM, os.cpu_count() or 1)))

__all__ = ["allreduce", "reduce_gradients", "average_gradients", "broadcast_variables", "broadcast_arrays",
           "average_metrics", "host_call", "CurrentAverager", "follow_the_world", "swap_class"]

_SWAPPED: dict = {}         # (mixin, class) -> the subclass swap_class made


def _in_xla() -> bool:
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def host_call(fn: Callable[..., List[np.ndarray]], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
              name: str) -> List[tf.Tensor]:
    """Run ``fn(*numpy arrays) -> list of arrays`` now (eager) or as one stateful graph op (``tf.function``)."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(o) for o in fn(*[np.asarray(t.numpy()) for t in inputs])]
    if _in_xla():
        raise RuntimeError(f"hpctrain's {name} runs Python between steps (tf.numpy_function), which XLA cannot "
                           "compile: use tf.function(jit_compile=False), or model.compile(..., jit_compile=False) "
                           "with Keras (Keras turns XLA on by default on GPUs)")
    outs = tf.numpy_function(lambda *arrays: list(fn(*arrays)), list(inputs), Tout=list(out_dtypes),
                             stateful=True, name=f"hpctrain_{name}")
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def swap_class(obj, mixin: type, prefix: str) -> None:
    """Give ``obj`` (a Keras optimizer) the class ``<prefix><its class>``, a subclass of its own with ``mixin`` first
    (made once per class: ``isinstance``, ``get_config`` and the optimizer's variables keep working)."""
    base = type(obj)
    cls = _SWAPPED.get((mixin, base))
    if cls is None:
        cls = _SWAPPED[(mixin, base)] = type(f"{prefix}{base.__name__}", (mixin, base),
                                             {"__module__": mixin.__module__})
    obj.__class__ = cls


class CurrentAverager:
    """The averager ``owner._hpctrain`` holds when a traced op runs, not the one it held when the step was traced
    (``tf.function`` and Keras trace once; in elastic mode each re-formed world brings a new averager)."""

    def __init__(self, owner):
        self._owner = owner

    def __getattr__(self, name):
        return getattr(self._owner._hpctrain, name)


def follow_the_world(owner, op: str, compression, policy, sparse_as_dense: bool) -> None:
    """Give ``owner._hpctrain`` (an averager made without ``comm=``) a new one over each re-formed world.

    Held weakly; the compressor object carries over (only one that keeps no
    state between steps: the others are refused under HPCTRAIN_ELASTIC).
    """
    from ..adasum_updates import AdasumUpdates
    from ..world import on_reform

    def rebuild(held, world):
        old = held._hpctrain
        if isinstance(old, AdasumUpdates):
            held._hpctrain = AdasumUpdates(world, compression)
        else:
            kept = old.compressor if old.compressor is not None else compression
            held._hpctrain = GradientAverager(world, op, kept, policy, sparse_as_dense)
    on_reform(rebuild, owner=owner)


def allreduce(tensor: Any, op: str = "sum", comm=None) -> tf.Tensor:
    """Return ``tensor`` reduced over ranks (default: summed, as every collective); see :meth:`Communicator.allreduce`.

    Works eagerly and inside ``tf.function``.  Formula: ``out = op(x_0, ..., x_{N-1})``.
    """
    comm = comm_or_world(comm)
    x = tf.convert_to_tensor(tensor)
    (out,) = host_call(lambda a: [comm.allreduce(np.require(a, requirements="C"), op=op)], [x], [x.dtype], "allreduce")
    out.set_shape(x.shape)
    return out


def reduce_gradients(grads: Sequence[Any], op: str = "avg", comm=None, sparse_as_dense: bool = False,
                     compression=None, names: Optional[Sequence[str]] = None,
                     compression_policy: Optional[Policy] = None) -> List[Any]:
    """Return the gradients reduced over ranks: dense ones fused, ``IndexedSlices`` gathered; None stays None.

    Dense gradients go through one :meth:`Communicator.grouped_allreduce`
    (packed by dtype into fusion buffers, the same fusion as everywhere in
    hpctrain).  A sparse ``tf.IndexedSlices`` gradient (embedding lookups)
    follows the sparse policy of :mod:`hpctrain.gradients`, the same as
    PyTorch's: every rank's rows and indices are gathered, values divided by
    N for ``op="avg"``, which an optimizer's scatter-add turns into the
    averaged dense gradient; ``sparse_as_dense=True`` densifies it first.  All
    the communication of one call is one graph op inside ``tf.function``.  On
    one rank nothing is sent.

    Cost: ``2 (N-1)/N`` x dense bytes per rank for ring-like all-reduces; the
    sparse rows of all ranks for each gathered gradient.

    ``compression``: a compressor of :mod:`hpctrain.compression` (or its name)
    for the dense gradients, named by ``names`` (the variables' paths; the
    compressor keeps per-name state and ``compression_policy`` picks tensors
    by name) or ``grad<i>``.  It runs on one rank too, so a 1-rank run trains
    with the same method.  Its traffic:
    ``hpctrain.compression.reducer_for(compressor, comm).stats()``.
    """
    averager = GradientAverager(comm, op, compression, compression_policy, sparse_as_dense)
    return average_gradients(averager, grads, names)


def average_gradients(averager: GradientAverager, grads: Sequence[Any],
                      names: Optional[Sequence[str]] = None) -> List[Any]:
    """:func:`reduce_gradients` through a :class:`~hpctrain.gradients.GradientAverager` the caller keeps (its stats).

    Counts one step on the averager whenever it communicates.
    """
    if names is not None and len(names) != len(grads):
        raise ValueError(f"reduce_gradients got {len(names)} names for {len(grads)} gradients")
    grads = [tf.convert_to_tensor(g) if averager.sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
             for g in grads]
    if not averager.communicates:
        return grads
    dense = [i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)]
    inputs = [tf.convert_to_tensor(grads[i]) for i in dense]
    for i in sparse:
        inputs += [grads[i].indices, grads[i].values]
    if not inputs:
        return grads
    nd = len(dense)
    keys = [str(names[i]) if names is not None else f"grad{i}" for i in dense]

    def communicate(*arrays):
        out = averager.reduce(arrays[:nd], keys)
        for k in range(nd, len(arrays), 2):
            out += averager.gather_rows(arrays[k], arrays[k + 1])
        return out

    outs = host_call(communicate, inputs, [t.dtype for t in inputs], "reduce_gradients")
    result = list(grads)
    for i, t, o in zip(dense, inputs, outs):
        o.set_shape(t.shape)
        result[i] = o
    for k, i in enumerate(sparse):
        indices, values = outs[nd + 2 * k], outs[nd + 2 * k + 1]
        values.set_shape([None] + grads[i].values.shape[1:].as_list())
        indices.set_shape([None])
        result[i] = tf.IndexedSlices(values, indices, dense_shape=grads[i].dense_shape)
    return result


def broadcast_variables(variables: Sequence[Any], root: int = 0, comm=None) -> None:
    """Assign ``root``'s values to ``variables`` on every rank (tf.Variable or Keras 3 variables), eagerly.

    Every rank passes the same number of variables with the same shapes and
    dtypes, in the same order (``model.variables``, ``optimizer.variables``);
    otherwise every rank raises ValueError naming the ranks that differ.
    Cost: one broadcast per dtype of the total bytes, one copy in and out.
    """
    if not tf.executing_eagerly():
        raise RuntimeError("broadcast_variables runs eagerly: call it outside tf.function (before training)")
    variables = list(variables)
    got = broadcast_arrays([np.asarray(v.numpy()) for v in variables], root, comm)
    for v, a in zip(variables, got):
        v.assign(a)


def broadcast_arrays(arrays: Sequence[np.ndarray], root: int = 0, comm=None) -> List[np.ndarray]:
    """Return ``root``'s ``arrays`` on every rank: one broadcast per dtype (see :func:`broadcast_variables`)."""
    comm = comm_or_world(comm)
    arrays = [np.asarray(a) for a in arrays]
    check_same(comm, "the variables to broadcast (shape, dtype)", [(a.shape, str(a.dtype)) for a in arrays],
               f"{len(arrays)} variables")
    by_dtype = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(str(a.dtype), []).append(i)
    out: List[Any] = [None] * len(arrays)
    for _, members in sorted(by_dtype.items()):
        flat = np.concatenate([arrays[i].reshape(-1) for i in members])
        got = comm.broadcast(flat, root=root)
        off = 0
        for i in members:
            n = arrays[i].size
            out[i] = got[off:off + n].reshape(arrays[i].shape)
            off += n
    return out
