"""Horovod 0.28's API on hpctrain's core: ``hpctrain.horovod.torch``, ``.tensorflow``, ``.keras``.

Change one import (``import horovod.torch as hvd`` to
``import hpctrain.horovod.torch as hvd``) and the script runs on hpctrain,
with or without Horovod installed.  :mod:`hpctrain.horovod.basics` holds the
framework-neutral part, :mod:`hpctrain.horovod.controller` Horovod's
negotiation of collectives by name.  Importing this package imports no
framework.
"""
from .runner import run

__all__ = ["run"]
