"""Horovod's Keras callbacks for the standalone ``keras`` package; see :mod:`hpctrain.tensorflow.keras_callbacks`."""
import keras as _keras

from ..keras_api import callback_classes as _callback_classes

_CALLBACK = _keras.callbacks.Callback

_classes = _callback_classes(_CALLBACK, __name__)
globals().update(_classes)
__all__ = list(_classes)
