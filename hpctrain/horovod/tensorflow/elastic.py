"""``hvd.elastic`` of ``hpctrain.horovod.tensorflow`` (and of ``hpctrain.horovod.keras``): Horovod's ``run``,
``State``, ``ObjectState``, ``TensorFlowKerasState`` / ``KerasState`` and the Keras callbacks that keep the
state's counters.

See :mod:`hpctrain.horovod.elastic` for how a reset works here and what differs from Horovod.
"""
from __future__ import annotations

from typing import Any, List

from ...tensorflow.elastic_state import KerasState as _CoreKerasState
from ..elastic import ObjectState, State, run
from .functions import broadcast_variables

__all__ = ["run", "State", "ObjectState", "TensorFlowKerasState", "KerasState"]   # (and the callbacks: __getattr__)


class TensorFlowKerasState(State, _CoreKerasState):
    """Horovod's ``TensorFlowKerasState(model, optimizer=None, backend=None, **kwargs)``: the variables of a Keras
    model and optimizer and named values (``state.epoch``), saved by ``commit()`` and broadcast from rank 0 by
    ``sync()`` (``backend`` is accepted and unused)."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **values: Any):
        self._track_hosts()
        _CoreKerasState.__init__(self, model, optimizer, **values)

    def _broadcast_variables(self, comm, variables: List[Any]) -> None:
        broadcast_variables(variables, root_rank=0)


KerasState = TensorFlowKerasState       # (horovod.keras.elastic's name, with the same arguments)


def _callback_base():
    import keras

    return keras.callbacks.Callback


def _callbacks():
    """Horovod's three Keras callbacks of elastic training, made on first use (importing Keras is slow)."""
    base = _callback_base()

    class CommitStateCallback(base):
        """``state.commit()`` every ``batches_per_commit`` batches and at each epoch's end."""

        def __init__(self, state, batches_per_commit: int = 1):
            super().__init__()
            self.state, self.batches_per_commit, self._remaining = state, batches_per_commit, batches_per_commit

        def on_batch_end(self, batch, logs=None):
            self._remaining -= 1
            if self._remaining == 0:
                self.state.commit()
                self._remaining = self.batches_per_commit

        def on_epoch_end(self, epoch, logs=None):
            self.state.commit()
            self._remaining = self.batches_per_commit

    class UpdateBatchStateCallback(base):
        """Keep ``state.batch`` at the batches done in this epoch (0 after the epoch)."""

        def __init__(self, state):
            super().__init__()
            self.state = state

        def on_batch_end(self, batch, logs=None):
            self.state.batch = batch + 1

        def on_epoch_end(self, epoch, logs=None):
            self.state.batch = 0

    class UpdateEpochStateCallback(base):
        """Keep ``state.epoch`` at the next epoch to run (after each epoch)."""

        def __init__(self, state):
            super().__init__()
            self.state = state

        def on_epoch_end(self, epoch, logs=None):
            self.state.epoch = epoch + 1

    return {"CommitStateCallback": CommitStateCallback, "UpdateBatchStateCallback": UpdateBatchStateCallback,
            "UpdateEpochStateCallback": UpdateEpochStateCallback}


_MADE: dict = {}


def __getattr__(name: str):
    if name in ("CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"):
        if not _MADE:
            _MADE.update(_callbacks())
        return _MADE[name]
    if name == "TensorFlowState":
        raise NotImplementedError("hvd.elastic.TensorFlowState (TF1 sessions) is not built in hpctrain: use "
                                  "TensorFlowKerasState with eager TensorFlow 2")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
