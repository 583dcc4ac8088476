"""``op="adasum"`` for TensorFlow optimizers: the local update, then Adasum of the variables' deltas.

The rule and its cost are :mod:`hpctrain.adasum_updates`'s; this module
only snapshots the variables, runs the optimizer's own update and writes
``start + adasum(deltas)`` back, eagerly or inside ``tf.function`` (there the
combination is one stateful graph op, :func:`hpctrain.tensorflow.ops.host_call`,
ordered after the update by TensorFlow's automatic control dependencies on
the variables).  Keras 3 and Keras 2 (``tf-keras``) optimizers share it.
Variables that are not float32/float64 travel as float32.  In a TF1 graph
(a ``tf.compat.v1.Session``) the op returned groups the update and the
assignments, since a session runs only what it fetches.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import tensorflow as tf

from ..adasum_updates import AdasumUpdates
from .ops import host_call

__all__ = ["apply_with_adasum"]

_WIRE = (tf.float32, tf.float64)


def _read(v) -> tf.Tensor:
    return tf.identity(tf.convert_to_tensor(v))


def apply_with_adasum(updates: AdasumUpdates, variables: Sequence[Any], apply_fn: Callable[[], Any]) -> Any:
    """Run ``apply_fn()`` (this rank's update of ``variables``), then set each variable to its value before
    plus the Adasum over ranks of its change; return what ``apply_fn`` returned."""
    variables = list(variables)
    if not updates.communicates or not variables:
        return apply_fn()
    starts = [_read(v) for v in variables]
    with tf.control_dependencies(starts):
        result = apply_fn()
    waits = [] if tf.executing_eagerly() or result is None else [result]
    with tf.control_dependencies(waits):
        deltas = [_read(v) - s for v, s in zip(variables, starts)]
    wire = [d if d.dtype in _WIRE else tf.cast(d, tf.float32) for d in deltas]
    combined = host_call(lambda *ds: updates.combine(ds), wire, [d.dtype for d in wire], "adasum")
    assigns = []
    for v, s, c in zip(variables, starts, combined):
        c.set_shape(s.shape)
        assigns.append(v.assign(s + tf.cast(c, s.dtype)))
    if tf.executing_eagerly() or tf.compat.v1.get_default_graph().building_function:
        return result            # (inside tf.function the assignments run anyway: they are stateful)
    return tf.group(*([result] if result is not None else []), *assigns)    # a TF1 graph runs what is fetched
