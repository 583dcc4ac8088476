"""The elastic state of a Keras 3 / TensorFlow training run: a model's and an optimizer's variables, and named values."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..checkpoint.state import variables_of
from ..elastic.state import ObjectState
from .ops import broadcast_variables

__all__ = ["KerasState"]

_HELD = ("model", "optimizer")


class KerasState(ObjectState):
    """:class:`~hpctrain.elastic.ObjectState` with a Keras ``model`` and ``optimizer`` (either may be None).

    A commit copies the variables (``model.variables``, ``optimizer.variables``:
    weights, moments, the iteration count) into host memory as numpy arrays;
    a restore assigns them back; :meth:`sync` broadcasts rank 0's variables
    (one broadcast per dtype) and its other values as one object.  A Keras
    optimizer makes its variables at its first step: a commit from before it
    restores the model only.  Also works for Keras 2 (``tf-keras``) and a
    ``tf.Module`` (their ``variables``).  Cost of a commit: one copy of the variables.
    """

    # (added hosts restart the job: a new rank's Keras optimizer has no variables before its first step, so it
    # could not take rank 0's by a broadcast; hpctrain.elastic.grow spawns ranks only for states that can)
    grows_in_place = False

    def __init__(self, model: Any = None, optimizer: Any = None, **values: Any):
        for name in _HELD:
            if name in values:
                raise ValueError(f"KerasState: {name!r} is a name of its own; pick another for that value")
        held = {k: v for k, v in (("model", model), ("optimizer", optimizer)) if v is not None}
        for name, obj in held.items():
            if variables_of(obj) is None:
                raise TypeError(f"KerasState: the {name} has no list of variables (a Keras model or optimizer, "
                                f"or a tf.Module); got {type(obj).__name__}")
        super().__init__(**held, **values)

    def _capture(self, names: Optional[Sequence[str]] = None, copy_values: bool = True) -> Dict[str, Any]:
        names = list(self._names if names is None else names)
        out = super()._capture([n for n in names if n not in _HELD], copy_values)
        for name in names:
            if name in _HELD:
                out[name] = [np.array(v.numpy()) if copy_values else np.asarray(v.numpy())
                             for v in variables_of(getattr(self, name))]
        return out

    def _apply(self, saved: Dict[str, Any]) -> None:
        super()._apply({k: v for k, v in saved.items() if k not in _HELD})
        for name in _HELD:
            if name in saved:
                _assign(variables_of(getattr(self, name)), saved[name], name)

    def _sync(self, comm) -> None:
        for name in _HELD:
            if name in self._names:
                self._broadcast_variables(comm, variables_of(getattr(self, name)))
        self._sync_values(comm, _HELD)

    def _broadcast_variables(self, comm, variables: List[Any]) -> None:
        """Rank 0's values of ``variables`` on every rank (hpctrain's broadcast; Horovod's in hvd's state)."""
        broadcast_variables(variables, root=0, comm=comm)


def _assign(variables: List[Any], saved: List[np.ndarray], name: str) -> None:
    """Assign ``saved`` to ``variables``; an optimizer committed before its first step (no variables) is left."""
    if not saved and variables:
        return
    if len(saved) != len(variables):
        raise ValueError(f"KerasState: the {name} has {len(variables)} variables, the commit {len(saved)}")
    for v, s in zip(variables, saved):
        v.assign(s)
