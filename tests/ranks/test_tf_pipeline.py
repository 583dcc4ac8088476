"""The Keras pipeline (pp = N, and dp=2 x pp=2 at 4 ranks) trains like one process training the whole model.

Stages are built from one seed on every rank, and the single-process
reference chains the same layers; after 10 steps of SGD with momentum, with
GPipe at 1 and 2 micro-batches and 1F1B at 3 (a remainder), the
stage's variables equal the reference's within 1e-5 relative and the losses
agree each step.
"""
import keras
import numpy as np
import pytest
import tensorflow as tf

import hpctrain.tensorflow as htf
from hpctrain.parallel import ParallelLayout

B, STEPS, WIDTHS = 8, 10, [16, 16, 16, 3]


def make_stages(p):
    """The network as ``p`` stages of Dense layers (the same weights on every rank and in the reference)."""
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(w, activation="tanh" if k < len(WIDTHS) - 1 else None)
              for k, w in enumerate(WIDTHS)]
    per = np.array_split(np.arange(len(layers)), p)
    stages, width = [], 6
    for idx in per:
        stage = keras.Sequential([keras.Input((width,))] + [layers[k] for k in idx])
        stages.append(stage)
        width = WIDTHS[idx[-1]]
    return stages


def data(step, replica):
    rng = np.random.default_rng([step, replica])
    return rng.standard_normal((B, 6)).astype(np.float32), rng.integers(0, 3, B)


def layouts(n):
    return [(1, n)] + ([(2, 2)] if n == 4 else [])


# (one micro-batch makes GPipe and 1F1B the same list of actions, F0 B0 on every stage: tests/test_pipeline_schedule.py)
# (the schedules themselves are framework-neutral: tests/test_pipeline_schedule.py and test_pipeline.py run every
# pair; here the Keras stages under each schedule, 1F1B with a remainder)
@pytest.mark.parametrize("m, schedule", [(1, "gpipe"), (2, "gpipe"), (3, "1f1b")])
def test_keras_pipeline_equals_one_process(comm, schedule, m):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for dp, pp in layouts(comm.size):
        layout = ParallelLayout(dp=dp, pp=pp, comm=comm)
        pipe = htf.Pipeline(make_stages(pp), layout, micro_batches=m, schedule=schedule, loss_fn=loss_fn)
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        ref_stages = make_stages(pp)
        ref_vars = [v for s in ref_stages for v in s.trainable_variables]
        ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
        replica = layout.coords["dp"]

        def reference(x):
            for s in ref_stages:
                x = s(x)
            return x

        for step in range(STEPS):
            x, y = data(step, replica)
            loss, grads = pipe.train_step(x, y)
            grads = htf.reduce_gradients(grads, comm=layout.dp_comm)
            opt.apply(grads, pipe.trainable_variables)
            want_loss = float(loss_fn(y, reference(x)))
            xs, ys = zip(*(data(step, k) for k in range(dp)))
            with tf.GradientTape() as tape:
                ref_loss = loss_fn(np.concatenate(ys), reference(np.concatenate(xs)))
            ref_opt.apply(tape.gradient(ref_loss, ref_vars), ref_vars)
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (step, loss, want_loss)
        got = np.concatenate([v.numpy().reshape(-1) for v in pipe.trainable_variables])
        want = np.concatenate([v.numpy().reshape(-1) for v in ref_stages[layout.stage].trainable_variables])
        err = float(np.abs(got - want).max() / np.abs(want).max())
        assert err <= 1e-5, f"dp={dp} pp={pp} {schedule} m={m}: relative error {err:.3g}"
        layout.free()


def test_bad_pipeline_arguments_are_refused(comm):
    layout = ParallelLayout(pp=comm.size, comm=comm)
    with pytest.raises(ValueError, match="stages for a pipeline of"):
        htf.Pipeline(make_stages(comm.size) + [keras.layers.Dense(2)], layout, micro_batches=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        htf.Pipeline(make_stages(comm.size), layout, micro_batches=2, schedule="zigzag")


def test_a_stage_that_does_not_fit_makes_every_rank_raise(comm):
    """Stage 1 expects 7 features where stage 0 sends 16: every rank raises PipelineError naming stage 1."""
    if comm.size < 2:
        pytest.skip("needs two pipeline stages")
    layout = ParallelLayout(pp=comm.size, comm=comm)
    stages = make_stages(comm.size)
    stages[1] = keras.Sequential([keras.Input((7,)), keras.layers.Dense(16 if comm.size > 2 else 3)])
    pipe = htf.Pipeline(stages, layout, micro_batches=2, schedule="1f1b")
    x, y = data(0, 0)
    with pytest.raises(htf.PipelineError, match=r"stage 1 \(rank 1\) failed in F of micro-batch 0"):
        pipe.train_step(x, y)
