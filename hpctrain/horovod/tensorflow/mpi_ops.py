"""Horovod's TensorFlow ops (``_allreduce``, ``allgather``, ``broadcast``, ...) on hpctrain's negotiated core.

Each op converts its tensors to numpy, starts the request of
:mod:`hpctrain.horovod.requests` and waits for it: eagerly at once, inside
``tf.function`` as one stateful graph op (:func:`hpctrain.tensorflow.ops.host_call`,
so ranks issue requests in program order; XLA is refused with a clear
error).  Errors arrive as Horovod's TensorFlow ops raise them: ranks that
disagree give ``tf.errors.FailedPreconditionError`` on every rank, an
argument that is invalid on every rank ``tf.errors.InvalidArgumentError``.

Gradients (``tf.custom_gradient``, Horovod's conventions):

* allreduce: the same reduction (op and scale factors) of the output's gradient;
* allgather: the gradients averaged over the ranks, then this rank's rows;
* broadcast: the gradients averaged over the ranks on the root, zero elsewhere;
* alltoall: the gradients sent back with the received splits;
* reducescatter: the gradients gathered, times the ranks for Sum and the scale factors.
"""
from __future__ import annotations

import logging
import re
import weakref
from typing import Callable, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from ...errors import CollectiveMismatchError, InvalidCollectiveError
from ...tensorflow.ops import host_call
from .. import basics, requests
from ..basics import Average, Sum, global_process_set
from ..requests import set_rank, set_size

__all__ = ["_allreduce", "_grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "alltoall", "_reducescatter", "_grouped_reducescatter", "join", "size_op", "local_size_op", "rank_op",
           "local_rank_op", "process_set_included_op"]


_plain = tf.autograph.experimental.do_not_convert     # plain Python: AutoGraph need not rewrite it
log = logging.getLogger("hpctrain")


class _InvalidArgument(tf.errors.InvalidArgumentError, ValueError):
    """An InvalidArgumentError that TF1 sessions' Python ops report as such too (they map ValueError)."""


def _wait(handle):
    """The request's result, its errors as TensorFlow's op errors."""
    try:
        return handle.wait()
    except InvalidCollectiveError as exc:
        raise _InvalidArgument(None, None, str(exc)) from exc
    except CollectiveMismatchError as exc:
        raise tf.errors.FailedPreconditionError(None, None, str(exc)) from exc


def _failed_precondition() -> tf.Tensor:
    """An op that raises FailedPreconditionError when it runs (reading a variable that never exists)."""
    handle = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[],
                                    shared_name="hpctrain_collective_failed_see_the_error_logged_above")
    return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.int32)


def _run(name: str, start: Callable[..., object], inputs: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
         finish: Callable = lambda r: [r]) -> List[tf.Tensor]:
    """Start a request on the inputs' numpy arrays and wait for it, eagerly or as one graph op.

    In a graph (``tf.function``, TF1 sessions) TensorFlow reports every
    exception of a Python op as UnknownError except ValueError/TypeError
    (InvalidArgumentError); there, ranks that disagree are logged and the
    op's status output drives :func:`_failed_precondition`, so the error
    arrives as Horovod's FailedPreconditionError.
    """
    session = not tf.executing_eagerly()

    def fn(*arrays):
        try:
            outs = [np.asarray(o) for o in finish(_wait(start(*arrays)))]
        except tf.errors.FailedPreconditionError as exc:
            if not session:
                raise
            log.error("hpctrain.horovod: %s", exc.message)
            return [np.zeros(0, d.as_numpy_dtype) for d in out_dtypes] + [np.int32(1)]
        return outs + [np.int32(0)] if session else outs

    if not session:
        return host_call(fn, inputs, out_dtypes, name)
    *outs, failed = host_call(fn, inputs, list(out_dtypes) + [tf.int32], name)
    verdict = tf.cond(tf.equal(failed, 0), lambda: failed, _failed_precondition)
    with tf.control_dependencies([verdict]):
        return [tf.identity(o) for o in outs]


_NAMES_USED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()    # graph -> {name: uses}


def _graph_name(name: Optional[str], kind: str, x: tf.Tensor) -> Optional[str]:
    """The request's name: the caller's, else (in a graph) one fixed when the graph is built.

    Eagerly, unnamed requests are numbered in program order when they start.
    A graph (``tf.function``, a TF1 session) may run independent ops in any
    order, so there an unnamed op is named after its input tensor when it is
    built, as Horovod does: the same on every rank that builds the same graph.
    """
    if name is not None or tf.executing_eagerly():
        return name
    used = _NAMES_USED.setdefault(x.graph, {})
    base = f"{kind}.{re.sub('[^a-zA-Z0-9_]', '_', x.name)}"
    used[base] = used.get(base, 0) + 1
    return base if used[base] == 1 else f"{base}.{used[base] - 1}"


def _rows_unknown(x: tf.Tensor):
    """``x``'s static shape with dim 0 unknown (gathers and scatters change it)."""
    return tf.TensorShape([None]).concatenate(x.shape[1:]) if x.shape.rank else None


def _grouped_run(kind: str, name: Optional[str], request: Callable, xs: Sequence[tf.Tensor],
                 rows_vary: bool) -> List[tf.Tensor]:
    """One grouped request over ``xs``: ``request(arrays, name)`` starts it; outputs shaped like the inputs."""
    key = _graph_name(name, kind, xs[0])
    outs = _run(kind, lambda *arrays: request(arrays, key), xs, [x.dtype for x in xs], finish=list)
    for o, x in zip(outs, xs):
        o.set_shape(_rows_unknown(x) if rows_vary else x.shape)
    return outs


def _tensor(x) -> tf.Tensor:
    if isinstance(x, tf.IndexedSlices):
        raise TypeError("this op takes dense tensors; hvd.allreduce handles tf.IndexedSlices")
    return tf.convert_to_tensor(x)


# -- allreduce -------------------------------------------------------------------------
@_plain
def _allreduce(tensor, name: Optional[str] = None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
               ignore_name_scope=False, process_set=global_process_set) -> tf.Tensor:
    """Return ``tensor`` reduced over the set (default op Sum, as Horovod's low-level op); differentiable."""
    hop = basics.op_name(op)
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def forward(x):
        key = _graph_name(name, "allreduce", x)
        (out,) = _run("allreduce", lambda a: requests.allreduce(a, key, hop, pre, post, process_set), [x],
                      [x.dtype])
        out.set_shape(x.shape)

        def grad(dy):
            return _allreduce(dy, op=op, prescale_factor=pre, postscale_factor=post, process_set=process_set)
        return out, grad
    return forward(_tensor(tensor))


@_plain
def _grouped_allreduce(tensors, name: Optional[str] = None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set) -> List[tf.Tensor]:
    """Return each of ``tensors`` reduced over the set, in one request; differentiable."""
    hop = basics.op_name(op)
    pre, post = float(prescale_factor), float(postscale_factor)
    tensors = [_tensor(t) for t in tensors]

    @tf.custom_gradient
    def forward(*xs):
        outs = _grouped_run("grouped_allreduce", name, lambda arrays, key: requests.grouped_allreduce(
            arrays, key, hop, pre, post, process_set), xs, rows_vary=False)

        def grad(*dys):
            return _grouped_allreduce(list(dys), op=op, prescale_factor=pre, postscale_factor=post,
                                      process_set=process_set)
        return outs, grad
    return list(forward(*tensors))


# -- data-moving collectives -----------------------------------------------------------
def _allgather_plain(x: tf.Tensor, name, process_set) -> tf.Tensor:
    key = _graph_name(name, "allgather", x)
    (out,) = _run("allgather", lambda a: requests.allgather(a, key, process_set), [x], [x.dtype])
    out.set_shape(_rows_unknown(x))
    return out


def _my_rows(grad: tf.Tensor, x: tf.Tensor, process_set) -> tf.Tensor:
    """Average ``grad`` over the set and return the rows this rank contributed (``x``'s dim 0)."""
    reduced = _allreduce(grad, op=Average, process_set=process_set)
    counts = _allgather_plain(tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1]), None, process_set)
    me = set_rank(process_set)
    start = tf.reduce_sum(counts[:me])
    return reduced[start:start + counts[me]]


@_plain
def allgather(tensor, name: Optional[str] = None, ignore_name_scope=False,
              process_set=global_process_set) -> tf.Tensor:
    """Return every rank's ``tensor`` concatenated along dim 0 (which may differ per rank); differentiable."""
    @tf.custom_gradient
    def forward(x):
        def grad(dy):
            return _my_rows(dy, x, process_set)
        return _allgather_plain(x, name, process_set), grad
    return forward(_tensor(tensor))


@_plain
def grouped_allgather(tensors, name: Optional[str] = None, ignore_name_scope=False,
                      process_set=global_process_set) -> List[tf.Tensor]:
    """Return the allgather of each of ``tensors`` (one request); differentiable."""
    tensors = [_tensor(t) for t in tensors]

    @tf.custom_gradient
    def forward(*xs):
        outs = _grouped_run("grouped_allgather", name, lambda arrays, key: requests.grouped_allgather(
            arrays, key, process_set), xs, rows_vary=True)

        def grad(*dys):
            return [_my_rows(dy, x, process_set) for dy, x in zip(dys, xs)]
        return outs, grad
    return list(forward(*tensors))


@_plain
def broadcast(tensor, root_rank, name: Optional[str] = None, ignore_name_scope=False,
              process_set=global_process_set) -> tf.Tensor:
    """Return world rank ``root_rank``'s ``tensor`` on every rank of the set; differentiable."""
    @tf.custom_gradient
    def forward(x):
        key = _graph_name(name, "broadcast", x)
        (out,) = _run("broadcast", lambda a: requests.broadcast(a, root_rank, key, process_set), [x], [x.dtype])
        out.set_shape(x.shape)

        def grad(dy):
            reduced = _allreduce(dy, op=Average, process_set=process_set)
            return reduced if basics.rank() == root_rank else reduced * 0
        return out, grad
    return forward(_tensor(tensor))


@_plain
def broadcast_(variables, root_rank, name: Optional[str] = None, process_set=global_process_set):
    """Overwrite ``variables`` with world rank ``root_rank``'s values, in place; return their new values."""
    variables = list(variables)
    return [v.assign(broadcast(v, root_rank, None if name is None else f"{name}.{i}", process_set=process_set))
            for i, v in enumerate(variables)]


@_plain
def alltoall(tensor, splits=None, name: Optional[str] = None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send rows ``splits[i]`` of ``tensor`` to rank i of the set; return the rows received (and, when
    ``splits`` is given, the received splits).  Without ``splits`` dim 0 is split evenly; differentiable."""
    x = _tensor(tensor)
    s = tf.zeros([0], tf.int32) if splits is None else tf.convert_to_tensor(splits)

    @tf.custom_gradient
    def forward(x):
        key = _graph_name(name, "alltoall", x)

        def start(a, counts):
            problem = "" if counts.dtype in (np.int32, np.int64) else \
                f"alltoall splits must be integers, got {counts.dtype}"
            return requests.alltoall(a, None if splits is None else counts.ravel(), key, process_set, problem)
        out, received = _run("alltoall", start, [x, s], [x.dtype, tf.int32],
                             finish=lambda r: [r[0], np.asarray(r[1], dtype=np.int32)])
        out.set_shape(_rows_unknown(x))

        def grad(dy, _unused=None):
            back, _ = alltoall(dy, splits=received, process_set=process_set)
            return back
        return (out, received), grad
    out, received = forward(x)
    return (out, received) if splits is not None else out


@_plain
def _reducescatter(tensor, name: Optional[str] = None, op=Sum, ignore_name_scope=False,
                   process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> tf.Tensor:
    """Return this rank's block of dim 0 of the reduction (the first ``dim0 % n`` ranks get a row more)."""
    hop = basics.op_name(op)
    pre, post = float(prescale_factor), float(postscale_factor)

    @tf.custom_gradient
    def forward(x):
        key = _graph_name(name, "reducescatter", x)
        (out,) = _run("reducescatter", lambda a: requests.reducescatter(a, key, hop, pre, post, process_set), [x],
                      [x.dtype])
        out.set_shape(_rows_unknown(x))

        def grad(dy):
            return _scatter_grad(dy, hop, pre, post, process_set)
        return out, grad
    return forward(_tensor(tensor))


def _scatter_grad(dy: tf.Tensor, hop: str, pre: float, post: float, process_set) -> tf.Tensor:
    factor = (set_size(process_set) if hop == "sum" else 1) * pre * post
    return allgather(dy * tf.cast(factor, dy.dtype) if factor != 1 else dy, process_set=process_set)


@_plain
def _grouped_reducescatter(tensors, name: Optional[str] = None, op=Sum, ignore_name_scope=False,
                           process_set=global_process_set, prescale_factor=1.0,
                           postscale_factor=1.0) -> List[tf.Tensor]:
    """Return the reduce-scatter of each of ``tensors`` (one request); differentiable."""
    hop = basics.op_name(op)
    pre, post = float(prescale_factor), float(postscale_factor)
    tensors = [_tensor(t) for t in tensors]

    @tf.custom_gradient
    def forward(*xs):
        outs = _grouped_run("grouped_reducescatter", name, lambda arrays, key: requests.grouped_reducescatter(
            arrays, key, hop, pre, post, process_set), xs, rows_vary=True)

        def grad(*dys):
            return [_scatter_grad(dy, hop, pre, post, process_set) for dy in dys]
        return outs, grad
    return list(forward(*tensors))


# -- synchronisation and queries ---------------------------------------------------------
@_plain
def join() -> tf.Tensor:
    """Wait until every rank has joined (meanwhile take part in allreduces with zeros); return the last
    rank that joined, the same on every rank."""
    (out,) = host_call(lambda: [np.int32(basics.controller().join().wait())], [], [tf.int32], "join")
    return out


def _scalar(value: Callable[[], int], name: str) -> tf.Tensor:
    (out,) = host_call(lambda: [np.int32(value())], [], [tf.int32], name)
    out.set_shape([])
    return out


@_plain
def size_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """Return the size of process set ``process_set_id`` as a tensor, read when the op runs."""
    return _scalar(lambda: len(basics.controller().sets[process_set_id][0]), "size")


@_plain
def process_set_included_op(process_set_id: int = 0, name=None) -> tf.Tensor:
    """Return 1 when this rank belongs to process set ``process_set_id``, else 0, read when the op runs."""
    return _scalar(lambda: int(basics.controller().sets[process_set_id][1] is not None), "process_set_included")


@_plain
def local_size_op(name=None) -> tf.Tensor:
    """Return the number of ranks on this node, read when the op runs."""
    return _scalar(basics.local_size, "local_size")


@_plain
def rank_op(name=None) -> tf.Tensor:
    """Return this process's rank, read when the op runs."""
    return _scalar(basics.rank, "rank")


@_plain
def local_rank_op(name=None) -> tf.Tensor:
    """Return this process's rank on its node, read when the op runs."""
    return _scalar(basics.local_rank, "local_rank")
