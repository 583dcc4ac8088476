"""Horovod 0.28's ``horovod.keras`` API on hpctrain, for the standalone ``keras`` package (Keras 3).

The names (:data:`hpctrain.horovod.keras_api.PUBLIC`) come from
:func:`hpctrain.horovod.keras_api.populate`; ``callbacks`` holds Horovod's
Keras callbacks.
"""
import keras as _keras

from ..keras_api import PUBLIC as _PUBLIC
from ..keras_api import populate as _populate
from . import callbacks

_populate(globals(), _keras, __name__)
__all__ = _PUBLIC + ["callbacks"]
