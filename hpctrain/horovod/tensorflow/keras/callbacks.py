"""Horovod's Keras callbacks for ``tf.keras`` (Keras 3, or Keras 2 from ``tf-keras``).

BroadcastGlobalVariablesCallback, MetricAverageCallback,
LearningRateScheduleCallback, LearningRateWarmupCallback: see
:mod:`hpctrain.tensorflow.keras_callbacks` for what each does.
"""
import tensorflow as _tf

from ...keras_api import callback_classes as _callback_classes

_CALLBACK = _tf.keras.callbacks.Callback

_classes = _callback_classes(_CALLBACK, __name__)
globals().update(_classes)
__all__ = list(_classes)
