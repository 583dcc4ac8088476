"""Helpers Horovod's TensorFlow code and tests import from ``horovod.tensorflow.util``."""
from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """Return whether TensorFlow runs eagerly here (not inside ``tf.function`` or a TF1 graph)."""
    return tf.executing_eagerly()
