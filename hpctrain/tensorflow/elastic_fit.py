"""Keras ``fit`` in elastic training that goes on in the middle of an epoch after a re-forming.

Keras's own ``fit`` knows epochs, not samples: restarted by ``hpctrain.elastic.run``
after ranks failed, it would run the interrupted epoch's batches again (Horovod's
Keras elastic recipe does), so the samples before the failure would be seen twice
in that epoch.  :func:`elastic_fit` runs ``fit`` one epoch at a time on this rank's
share of what the epoch has left, as the state's
:class:`~hpctrain.elastic.ElasticSampler` deals it: after a re-forming, the
restored sampler deals the epoch's unseen samples over the new size, and
the epoch goes on with them (no sample of the epoch skipped or seen twice,
whatever the sizes; the last ``len % (size * batch_size)`` of an epoch's rest
are left out, as ``drop_last``).

Per batch the callback records the batch in the sampler and commits every
``batches_per_commit`` batches; each epoch's end commits with the next epoch
named.  Cost: one ``fit`` call a epoch (Keras keeps the traced step), the
gathered ``x[idx]`` copy of this rank's share, and the commits.
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

import numpy as np

__all__ = ["elastic_fit"]


def _take(data: Any, idx: np.ndarray) -> Any:
    """``data`` (an array, or a list, tuple or dict of arrays) at rows ``idx``."""
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: _take(v, idx) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_take(v, idx) for v in data)
    return np.asarray(data)[idx]


def _commit_callback(state, batch_size: int, batches_per_commit: int):
    import keras

    class ElasticCommit(keras.callbacks.Callback):
        """Record each batch in the state's sampler; ``state.commit()`` every ``batches_per_commit`` batches."""

        def __init__(self):
            super().__init__()
            self.done = 0

        def on_train_batch_end(self, batch, logs=None):
            state.sampler.record_batch(batch_size)
            self.done += 1
            if self.done % batches_per_commit == 0:
                state.commit()

    return ElasticCommit()


def elastic_fit(model, x, y=None, *, state, batch_size: int, epochs: int, batches_per_commit: int = 1,
                callbacks: Sequence[Any] = (), verbose: Any = "auto", **fit_kwargs) -> Dict[str, List[float]]:
    """``model.fit`` over ``epochs`` from ``state.epoch`` on, resuming mid-epoch after a re-forming (module docstring).

    Call it inside ``@hpctrain.elastic.run``; ``state`` is a
    :class:`~hpctrain.tensorflow.KerasState` holding ``sampler`` (an
    :class:`~hpctrain.elastic.ElasticSampler` over ``len(x)`` samples) and
    ``epoch``.  ``x``/``y``: numpy arrays (or lists, tuples, dicts of them)
    of the whole data set, the same on every rank; ``batch_size`` is per rank.
    ``callbacks`` and ``fit_kwargs`` go to each epoch's ``fit`` (its
    ``on_train_begin``/``end`` then run once an epoch; the commit runs after
    their ``on_train_batch_end``, so values they update are committed).  ``verbose`` is 0 on
    ranks other than 0.  Returns the epochs' logs, as ``History.history``.
    """
    import hpctrain

    for name in ("sampler", "epoch"):
        if not hasattr(state, name):
            raise ValueError(f"elastic_fit: the state needs a {name!r} value (KerasState(model, optimizer, "
                             f"sampler=ElasticSampler(len(x)), epoch=0))")
    for name in ("epochs", "initial_epoch", "batch_size", "shuffle", "steps_per_epoch"):
        if name in fit_kwargs:
            raise ValueError(f"elastic_fit sets fit's {name!r} itself (the state's epoch and sampler decide)")
    if batch_size < 1 or batches_per_commit < 1:
        raise ValueError(f"elastic_fit: batch_size ({batch_size}) and batches_per_commit ({batches_per_commit}) "
                         f"must be 1 or more")
    sampler = state.sampler
    commit = _commit_callback(state, batch_size, batches_per_commit)
    history: Dict[str, List[float]] = {}
    while state.epoch < epochs:
        if sampler.epoch != state.epoch:
            sampler.set_epoch(state.epoch)
        idx = sampler.indices()
        idx = idx[:len(idx) // batch_size * batch_size]
        if len(idx):
            quiet = verbose if hpctrain.world().rank == 0 else 0
            done = model.fit(_take(x, idx), _take(y, idx), batch_size=batch_size, epochs=state.epoch + 1,
                             initial_epoch=state.epoch, shuffle=False, callbacks=[*callbacks, commit],
                             verbose=quiet, **fit_kwargs)
            for key, values in done.history.items():
                history.setdefault(key, []).extend(values)
        state.epoch += 1                    # (the commit at an epoch's end names the next one: a re-forming
        sampler.set_epoch(state.epoch)      # that goes back to it starts there)
        state.commit()
    return history
