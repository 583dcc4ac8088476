"""Local variables in Horovod's TensorFlow gradient wrappers: reduce the others, keep (and scale) these.

``PartialDistributedGradientTape``, ``register_local_source`` and the Keras
optimizers' ``register_local_var`` share :func:`reduce_partial`.  A local
variable's gradient is not reduced; with ``scale_local_gradients`` it is
divided by the process set's size, as Horovod does, so that a learning rate
scaled for the averaged gradients suits it too.
"""
from __future__ import annotations

from typing import Any, Collection, List, Sequence

import tensorflow as tf

from ..tensorflow.ops import average_gradients
from ..tensorflow.tape import _name, var_key

__all__ = ["reduce_partial"]


def reduce_partial(averager, grads: Sequence[Any], variables: Sequence[Any], local: Collection,
                   set_size: int, scale_local: bool) -> List[Any]:
    """Return ``grads`` with those of non-``local`` variables (keys of ``var_key``) reduced by ``averager``."""
    is_local = [var_key(v) in local for v in variables]
    shared = [i for i, mine in enumerate(is_local) if not mine]
    out = list(grads)
    if shared:
        names = [_name(variables[i], i) for i in shared] if averager.compressor is not None else None
        for i, g in zip(shared, average_gradients(averager, [grads[i] for i in shared], names)):
            out[i] = g
    if scale_local and set_size > 1:
        for i in (i for i, mine in enumerate(is_local) if mine and out[i] is not None):
            g = out[i]
            out[i] = tf.IndexedSlices(g.values / set_size, g.indices, g.dense_shape) \
                if isinstance(g, tf.IndexedSlices) else g / set_size
    return out
