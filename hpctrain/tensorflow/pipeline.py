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
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from ..parallel.schedule import schedule as make_schedule

__all__ = ["Pipeline"]


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
        if loss_fn is None:
            import keras
            loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.loss_fn = loss_fn

    @property
    def trainable_variables(self):
        return self.stage_model.trainable_variables

    def train_step(self, x, y):
        """Forward and backward of one batch; returns (batch loss on every rank, this stage's gradients)."""
        if not tf.executing_eagerly():
            raise RuntimeError("the TensorFlow pipeline runs eagerly: call train_step outside tf.function")
        first, last, m = self.stage == 0, self.stage == self.stages - 1, self.micro_batches
        xs = np.array_split(np.asarray(x), m) if first else None
        ys = np.array_split(np.asarray(y), m) if last else None
        total = sum(len(v) for v in ys) if last else 0
        tapes, grads, losses, sends = {}, None, [], []
        for action in self.actions:
            i = action.micro
            if action.kind == "F":
                inp = tf.convert_to_tensor(xs[i] if first else self.comm.recv(self.stage - 1, tag=2 * i))
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
                    sends.append(self.comm.send_async(out.numpy(), self.stage + 1, tag=2 * i))
            else:
                tape, inp, out = tapes.pop(i)
                g = None if last else tf.convert_to_tensor(self.comm.recv(self.stage + 1, tag=2 * i + 1))
                got = tape.gradient(out, [inp] + list(self.trainable_variables), output_gradients=g)
                parts = [tf.zeros_like(v) if d is None else tf.convert_to_tensor(d)
                         for d, v in zip(got[1:], self.trainable_variables)]
                grads = parts if grads is None else [a + b for a, b in zip(grads, parts)]
                if not first:
                    sends.append(self.comm.send_async(got[0].numpy(), self.stage - 1, tag=2 * i + 1))
        for h in sends:
            h.wait()
        loss = np.array([sum(losses)], dtype=np.float64)
        loss = self.comm.broadcast(loss, root=self.stages - 1)
        return float(loss[0]), grads
