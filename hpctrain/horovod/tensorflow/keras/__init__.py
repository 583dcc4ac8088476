"""Horovod 0.28's ``horovod.tensorflow.keras`` API on hpctrain, for ``tf.keras``.

``tf.keras`` is Keras 3, or Keras 2 with ``TF_USE_LEGACY_KERAS=1`` and the
``tf-keras`` package: both work.  The names (:data:`hpctrain.horovod.keras_api.PUBLIC`)
come from :func:`hpctrain.horovod.keras_api.populate`; ``callbacks`` holds
Horovod's Keras callbacks.
"""
import tensorflow as _tf

from ...keras_api import PUBLIC as _PUBLIC
from ...keras_api import populate as _populate
from . import callbacks

_populate(globals(), _tf.keras, __name__)
__all__ = _PUBLIC + ["callbacks"]
