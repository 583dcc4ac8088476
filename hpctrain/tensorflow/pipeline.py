"""Pipeline parallelism for Keras stages, run by the same schedules as the PyTorch pipeline.

Each rank of the layout's pipeline group holds one stage (a Keras layer or
model).  ``train_step(x, y)`` splits the batch into ``m`` micro-batches and
runs :func:`hpctrain.parallel.schedule`'s actions eagerly: a forward records
the stage under a ``tf.GradientTape``; the backward asks that tape for the
gradients of the stage's variables and of its input, given the gradient of
its output that came back from the next stage
(``tape.gradient(out, [x] + variables, output_gradients=g)``).  Micro-batch
``i`` of ``b_i`` samples contributes ``(b_i / B) loss_i``, so the summed
gradients equal the whole batch's.  It returns ``(loss, grads)``: the batch
loss (on every rank of the pipeline) and this stage's gradients, in the order
of ``stage.trainable_variables``; average them over the data-parallel group
with :func:`hpctrain.tensorflow.reduce_gradients` (``comm=layout.dp_comm``)
and apply them with the optimizer.  Eager only (the schedule is Python).
Messages go through :mod:`hpctrain.parallel.links` (shapes travel once, a
failing stage makes every rank raise :class:`PipelineError`).
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from ..parallel.links import PipelineError, StageLinks
from ..parallel.schedule import schedule as make_schedule

__all__ = ["Pipeline", "PipelineError"]


class Pipeline:
    """This rank's stage of a pipeline of Keras stages.

    Args:
        stages: one Keras layer/model per stage (built or buildable), in order.
        layout: the :class:`~hpctrain.parallel.ParallelLayout`.
        micro_batches: ``m``.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        loss_fn: ``loss_fn(y_true, y_pred)`` returning the mean loss.
    """

    def __init__(self, stages, layout, micro_batches: int, schedule: str = "1f1b",
                 loss_fn: Optional[Callable] = None):
        stages = list(stages)
        p, s = layout.num_stages, layout.stage
        if len(stages) != p:
            raise ValueError(f"got {len(stages)} stages for a pipeline of {p} stages")
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.actions = make_schedule(schedule, p, micro_batches, s)
        self.stage_model, self.layout, self.comm = stages[s], layout, layout.pp_comm
        self.stage, self.stages, self.micro_batches = s, p, micro_batches
        self.links = StageLinks(self.comm, s)
        if loss_fn is None:
            import keras
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.loss_fn = loss_fn

    @property
    def trainable_variables(self):
        return self.stage_model.trainable_variables

    def infer(self, x) -> np.ndarray:
        """The whole model's output for ``x`` (needed on the first stage) as numpy, on every rank of the pipeline.

        One forward, no micro-batches; shapes travel with the messages (any batch size).
        """
        inp = np.asarray(x) if self.stage == 0 else self.comm.recv(self.stage - 1, tag=0)
        out = np.asarray(self.stage_model(tf.convert_to_tensor(inp), training=False))
        last = self.stages - 1
        if self.stage < last:
            self.comm.send(out, self.stage + 1, tag=0)
        meta = self.comm.broadcast_object((out.shape, out.dtype.str) if self.stage == last else None, root=last)
        return self.comm.broadcast(out if self.stage == last else np.zeros(meta[0], meta[1]), root=last)

    def train_step(self, x, y):
        """Forward and backward of one batch; returns (batch loss on every rank, this stage's gradients).

        A stage that fails sends the error along the pipeline in place of the
        messages it owed, so every rank raises :class:`PipelineError` naming it.
        """
        if not tf.executing_eagerly():
            raise RuntimeError("the TensorFlow pipeline runs eagerly: call train_step outside tf.function")
        first, last, m = self.stage == 0, self.stage == self.stages - 1, self.micro_batches
        xs = np.array_split(np.asarray(x), m) if first else None
        ys = np.array_split(np.asarray(y), m) if last else None
        total = sum(len(v) for v in ys) if last else 0
        if last and min(len(v) for v in ys) == 0:
            raise ValueError(f"a batch of {total} samples cannot make {m} micro-batches")
        tapes, grads, losses, sends = {}, None, [], []
        for k, action in enumerate(self.actions):
            i = action.micro
            try:
                if action.kind == "F":
                    inp = tf.convert_to_tensor(xs[i] if first else self.links.recv(self.stage - 1, 2 * i, "F"))
                    tape = tf.GradientTape()
                    with tape:
                        tape.watch(inp)
                        out = self.stage_model(inp, training=True)
                        if last:
                            out = self.loss_fn(ys[i], out) * (len(ys[i]) / total)
                    tapes[i] = (tape, inp, out)
                    if last:
                        losses.append(float(out))
                    else:
                        sends.append(self.links.send_async(out.numpy(), self.stage + 1, 2 * i, "F"))
                else:
                    tape, inp, out = tapes.pop(i)
                    g = None if last else tf.convert_to_tensor(self.links.recv(self.stage + 1, 2 * i + 1, "B"))
                    got = tape.gradient(out, [inp] + list(self.trainable_variables), output_gradients=g)
                    parts = [tf.zeros_like(v) if d is None else tf.convert_to_tensor(d)
                             for d, v in zip(got[1:], self.trainable_variables)]
                    grads = parts if grads is None else [a + b for a, b in zip(grads, parts)]
                    if not first:
                        d_inp = tf.zeros_like(inp) if got[0] is None else got[0]
                        sends.append(self.links.send_async(d_inp.numpy(), self.stage - 1, 2 * i + 1, "B"))
            except Exception as exc:
                text = str(exc) if isinstance(exc, PipelineError) else (
                    f"stage {self.stage} (rank {self.layout.comm.rank}) failed in {action.kind} of micro-batch "
                    f"{i}: {type(exc).__name__}: {exc}")
                self.links.fail_remaining(self.actions[k:], self.stages, text)
                raise PipelineError(text) from exc
        for h in sends:
            h.wait()
        loss = np.array([sum(losses)], dtype=np.float64)
        loss = self.comm.broadcast(loss, root=self.stages - 1)
        return float(loss[0]), grads
