"""Horovod's Keras ``DistributedOptimizer`` for Keras 3 and for Keras 2 (``tf-keras``), on hpctrain's gradients.

The optimizer passed in keeps its identity: its class becomes a subclass of
its own (same name, module ``hpctrain.horovod.keras_optimizer``) that reduces
the gradients over the process set before every update: in ``apply``
(Keras 3), or in Keras 2 (new and legacy optimizers) where Horovod does, in
``compute_gradients`` (which ``model.fit`` and ``minimize`` call), and in
``apply_gradients`` for gradients that did not come from there (a custom
loop's tape), so they are reduced exactly once.  The reduction is
:func:`hpctrain.tensorflow.ops.average_gradients` (one fused all-reduce of
the dense gradients, ``IndexedSlices`` gathered as rows or densified with
``sparse_as_dense``, hpctrain's compressors) over a negotiated communicator.
The subclass carries the settings, so ``from_config`` copies and
``load_model`` give optimizers that reduce too.

``op=hvd.Adasum``: each rank applies its own gradients and the variables'
changes are combined with Adasum (:mod:`hpctrain.adasum_updates`), as
Horovod's torch and TF1 Adasum optimizers do (Horovod's Keras wrapper
combines the gradients instead; for plain SGD the two are the same).

``backward_passes_per_step=k``: gradients accumulate locally (dense, in
variables beside the optimizer's) and are reduced and applied on every k-th
call only, averaged over the k passes when ``average_aggregated_gradients``;
the other calls only count ``iterations``.  Cost: one reduction per k
passes, and one extra copy of the trainable variables.  Local variables
(``register_local_var``) are never reduced; with ``scale_local_gradients``
their gradients are divided by the set's size, as Horovod does.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import tensorflow as tf

from ..adasum_updates import AdasumUpdates
from ..gradients import GradientAverager
from ..tensorflow.adasum_apply import apply_with_adasum
from ..tensorflow.aggregation import Aggregation
from ..tensorflow.tape import var_key
from .gradient_args import GradientSettings
from .requests import set_size
from .local_gradients import reduce_partial

__all__ = ["wrap_optimizer", "distributed_class", "HorovodKerasOptimizer"]


class HorovodKerasOptimizer:
    """Mixin of the optimizer subclasses; the class attribute ``_hpctrain_config`` holds Horovod's settings."""

    _hpctrain_config: dict = {}

    def _hpctrain_state(self) -> dict:
        state = self.__dict__.get("_hpctrain_runtime")
        if state is None:
            c = self._hpctrain_config
            k = c["backward_passes_per_step"]
            settings: GradientSettings = c["settings"]
            averager = AdasumUpdates(settings.comm, settings.compressor) if settings.op == "adasum" else \
                GradientAverager(settings.comm, settings.op, settings.compressor, sparse_as_dense=c["sparse_as_dense"])
            state = {"averager": averager,
                     "agg": Aggregation(k, c["average_aggregated_gradients"]) if k > 1 else None, "local": set()}
            self.__dict__["_hpctrain_runtime"] = state
        return state

    @property
    def _agg_helper(self) -> Optional[Aggregation]:
        """The local aggregation (None unless ``backward_passes_per_step > 1``)."""
        return self._hpctrain_state()["agg"]

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (not reduced; divided by the set's size when scaling)."""
        self._hpctrain_state()["local"].add(var_key(var))

    def compression_stats(self) -> dict:
        """Bytes of gradient payload sent and received, per step and in total (:meth:`GradientAverager.stats`)."""
        return self._hpctrain_state()["averager"].stats()

    def _reduce(self, grads: Sequence[Any], variables: Sequence[Any]) -> List[Any]:
        """``grads`` reduced over the set, local variables' kept (and scaled)."""
        state, c = self._hpctrain_state(), self._hpctrain_config
        return reduce_partial(state["averager"], grads, variables, state["local"], set_size(c["process_set"]),
                              c["scale_local_gradients"])

    def _reduce_and_apply(self, grads: Sequence[Any], variables: Sequence[Any], apply_fn) -> Any:
        """``apply_fn`` of the reduced gradients; with Adasum, of this rank's, then the variables combined."""
        state = self._hpctrain_state()
        if isinstance(state["averager"], AdasumUpdates):
            shared = [v for v in variables if var_key(v) not in state["local"]]
            return apply_with_adasum(state["averager"], shared, lambda: apply_fn(list(grads)))
        return apply_fn(self._reduce(grads, variables))

    def _hpctrain_update(self, grads: List[Any], variables: List[Any], apply_fn) -> Any:
        """Reduce and apply now, or (aggregating) accumulate and apply on every k-th pass."""
        agg = self._hpctrain_state()["agg"]
        if agg is None:
            return self._reduce_and_apply(grads, variables, apply_fn)
        self._build_for(variables)
        return agg.step(grads, variables, lambda totals: self._reduce_and_apply(totals, variables, apply_fn),
                        lambda: self.iterations.assign_add(1))

    def _build_for(self, variables) -> None:
        """Create the optimizer's own variables now: a ``tf.cond`` branch may not create them."""
        with tf.init_scope():
            if hasattr(self, "_create_all_weights"):           # Keras 2 legacy optimizers
                self._create_all_weights(variables)
            elif _is_keras3(self):
                if not self.built:
                    self.build(variables)
            elif not getattr(self, "_built", False):           # Keras 2 optimizers
                self.build(variables)

    # -- Keras 3 ---------------------------------------------------------------------
    def apply(self, grads, trainable_variables=None):
        """Keras 3: reduce ``grads`` over the set, then the wrapped optimizer's ``apply``."""
        variables = list(trainable_variables if trainable_variables is not None else self._trainable_variables)
        parent = super()
        return self._hpctrain_update(list(grads), variables, lambda g: parent.apply(g, variables))

    # -- Keras 2 (tf-keras) --------------------------------------------------------------
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """Keras 2 and Keras 3: reduce the gradients over the set (unless this optimizer's
        ``compute_gradients`` already did), then apply them."""
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if _is_keras3(self):                 # Keras 3's apply_gradients calls apply
            return super().apply_gradients(pairs, *args, **kwargs)
        parent = super()
        reduced = self.__dict__.pop("_hpctrain_reduced", set())
        if grads and all(g is None or id(g) in reduced for g in grads):
            return parent.apply_gradients(pairs, *args, **kwargs)
        return self._hpctrain_update(grads, variables,
                                     lambda g: parent.apply_gradients(list(zip(g, variables)), *args, **kwargs))

    def compute_gradients(self, loss, var_list, tape=None):
        """Keras 2: ``(gradient, variable)`` pairs of ``loss``, reduced over the set (kept local while
        aggregating over ``backward_passes_per_step``; then ``apply_gradients`` reduces)."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        parent = super()
        if hasattr(parent, "_compute_gradients"):
            pairs = parent._compute_gradients(loss, var_list=var_list, grad_loss=grad_loss, tape=tape)
        else:
            pairs = parent.compute_gradients(loss, var_list, tape=tape)
        return self._reduced_pairs(list(pairs))

    def get_gradients(self, loss, params):
        """Keras 2 legacy (graph mode): the gradients of ``loss``, reduced over the set."""
        return [g for g, _ in self._reduced_pairs(list(zip(super().get_gradients(loss, params), params)))]

    def _reduced_pairs(self, pairs: list) -> list:
        state = self._hpctrain_state()
        if state["agg"] is not None or isinstance(state["averager"], AdasumUpdates):
            return pairs            # reduced (or, with Adasum, combined) in apply_gradients
        grads = self._reduce([g for g, _ in pairs], [v for _, v in pairs])
        self.__dict__["_hpctrain_reduced"] = {id(g) for g in grads if g is not None}
        return [(g, v) for g, (_, v) in zip(grads, pairs)]


def _is_keras3(optimizer) -> bool:
    return hasattr(optimizer, "stateless_apply")          # Keras 3's optimizers have it, Keras 2's do not


_CLASSES: dict = {}


def distributed_class(base: type, settings: GradientSettings, process_set, sparse_as_dense: bool = False,
                      backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                      scale_local_gradients: bool = True) -> type:
    """Return the subclass of the optimizer class ``base`` that reduces over ``process_set`` (same name)."""
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    config = {"settings": settings, "process_set": process_set, "sparse_as_dense": bool(sparse_as_dense),
              "backward_passes_per_step": int(backward_passes_per_step),
              "average_aggregated_gradients": bool(average_aggregated_gradients),
              "scale_local_gradients": bool(scale_local_gradients)}
    return type(base.__name__, (HorovodKerasOptimizer, base),
                {"__module__": __name__, "_hpctrain_config": config, "__qualname__": base.__qualname__})


def wrap_optimizer(optimizer, *args, **kwargs):
    """Turn ``optimizer`` (Keras 3 or Keras 2) into a distributed one in place and return it; the
    arguments after it are :func:`distributed_class`'s."""
    if isinstance(optimizer, HorovodKerasOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    optimizer.__class__ = distributed_class(type(optimizer), *args, **kwargs)
    return optimizer
