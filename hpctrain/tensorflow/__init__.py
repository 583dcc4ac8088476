"""TensorFlow adapter: data-parallel training with GradientTape loops and Keras 3 on hpctrain's core.

Custom loops::

    import hpctrain, hpctrain.tensorflow as htf
    hpctrain.init()
    htf.broadcast_variables(model.variables, root=0)
    with tf.GradientTape() as tape:
        loss = ...
    grads = htf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)

Keras ``model.fit``: :mod:`hpctrain.tensorflow.keras`; in elastic training :func:`elastic_fit`.  Input sharding:
:func:`distributed_dataset` (the same split as the torch side's
:class:`hpctrain.data.DistributedSampler`).  Everything works eagerly and
inside ``tf.function`` (not under XLA); see :mod:`hpctrain.tensorflow.ops`.
"""
from .data import distributed_dataset
from .elastic_fit import elastic_fit
from .elastic_state import KerasState
from .ops import allreduce, average_metrics, broadcast_variables, reduce_gradients
from .pipeline import Pipeline, PipelineError
from .tape import DistributedGradientTape

__all__ = ["allreduce", "average_metrics", "broadcast_variables", "reduce_gradients", "DistributedGradientTape",
           "distributed_dataset", "Pipeline", "PipelineError", "KerasState", "elastic_fit"]
