"""Horovod's TensorFlow state helpers: broadcast_variables, broadcast_global_variables, object collectives.

``broadcast_variables`` works eagerly (the usual TF2 use, before training)
and inside ``tf.function`` or a TF1 graph: each variable is assigned the
root's value, variables of one dtype travelling in one broadcast
(:func:`hpctrain.tensorflow.ops.broadcast_arrays` over a negotiated
communicator).  The object collectives pickle on the sender and unpickle on
the receivers (as Horovod's; use them for small, trusted objects such as
configs).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import tensorflow as tf

from ...tensorflow.ops import broadcast_arrays, host_call
from ...tensorflow.ops import broadcast_variables as _broadcast_flat
from .. import requests
from ..basics import global_process_set
from ..negotiated import NegotiatedComm

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
           "allgather_object"]


def broadcast_variables(variables, root_rank: int, process_set=global_process_set, inplace: bool = False):
    """Assign world rank ``root_rank``'s values to ``variables`` on every rank of the set.

    Eagerly returns None; inside ``tf.function`` or a TF1 graph returns the
    group of assign ops (one negotiated request for all variables, so a TF1
    session holds one thread for it).  ``inplace`` is accepted (assignment is
    in place either way).
    """
    variables = list(variables)
    root = requests.root_index(root_rank, process_set)
    if tf.executing_eagerly():
        _broadcast_flat(variables, root=root, comm=NegotiatedComm(process_set))
        return None
    values = [tf.convert_to_tensor(v) for v in variables]
    got = host_call(lambda *arrays: broadcast_arrays(arrays, root, NegotiatedComm(process_set)), values,
                    [v.dtype for v in values], "broadcast_variables")
    return tf.group(*[v.assign(tf.reshape(g, v.shape)) for v, g in zip(variables, got)])


def broadcast_global_variables(root_rank: int):
    """Broadcast every TF1 global variable from ``root_rank`` (graph mode only, as in Horovod).

    Eagerly there are no global variables: RuntimeError says to use
    ``hvd.broadcast_variables(model.variables + optimizer.variables, root_rank)``.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution; use "
                           "hvd.broadcast_variables(<model/optimizer variables>, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session=None, name: Optional[str] = None,
                     process_set=global_process_set) -> Any:
    """Return world rank ``root_rank``'s picklable ``obj`` on every rank of the set (``session`` is ignored)."""
    return requests.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session=None, name: Optional[str] = None,
                        process_set=global_process_set) -> Callable[[Any], Any]:
    """Return a function ``f(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's TF1 helper)."""
    def fn(obj: Any) -> Any:
        return requests.broadcast_object(obj, root_rank, name, process_set)
    return fn


def allgather_object(obj: Any, session=None, name: Optional[str] = None, process_set=global_process_set) -> List[Any]:
    """Return every rank's picklable ``obj`` in rank order (``session`` is ignored)."""
    return requests.allgather_object(obj, name, process_set)
