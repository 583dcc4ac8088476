"""Data-parallel TensorFlow/Keras training equals single-process training on the concatenated batch.

Every rank also computes the reference itself: one process (no communication)
training a copy of the model on the batches of all ranks concatenated.  With a
mean loss, the average over N ranks of the gradient of batch B equals the
gradient of the N*B batch, so variables agree up to float32 rounding: 1e-5
relative after 20 steps at 1-4 ranks, 2e-5 beyond (the 6 ranks of the
multi-node tests: Adam, eager, measured 1.16e-5 on one host and on three
nodes; it divides by sqrt(v), so coordinates whose gradient nearly cancels
turn a rounding difference into a larger step).  Replicas must be
bit-identical after every step.
"""
import hashlib

import keras
import numpy as np
import pytest
import tensorflow as tf

import hpctrain.tensorflow as htf
import hpctrain.tensorflow.keras as hk
from hpctrain.data import DistributedSampler

B = 4
STEPS = 20
OPTIMIZERS = {"sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(0.01)}


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])


def global_batch(step, n, per_rank=B, seed=1234):
    rng = np.random.default_rng(seed + step)
    return (rng.standard_normal((n * per_rank, 6)).astype(np.float32),
            rng.integers(0, 3, n * per_rank).astype(np.int64))


def flat(variables):
    return np.concatenate([np.asarray(v.numpy(), dtype=np.float64).reshape(-1) for v in variables])


def assert_identical_across_ranks(comm, variables, what=""):
    digest = hashlib.sha256(np.concatenate([np.asarray(v.numpy()).reshape(-1).view(np.uint8)
                                            for v in variables]).tobytes()).hexdigest()
    digests = comm.allgather_object(digest)
    assert len(set(digests)) == 1, f"replicas differ {what}: {digests}"


def assert_close(got, want, n):
    rtol = 1e-5 if n <= 4 else 2e-5
    got, want = flat(got), flat(want)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rtol, f"max relative difference {err:.3g} > {rtol}"


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def resumes_bit_for_bit(comm, ckdir, optimizer, **wrapper):
    """Train 6 steps straight; train 3, checkpoint, restore into a fresh model (weights moved) and optimizer, train
    3 more: the weights must be bit for bit the straight run's.  ``optimizer()`` makes the Keras optimizer that
    ``hk.DistributedOptimizer(..., **wrapper)`` wraps."""
    from hpctrain.checkpoint import CheckpointManager

    n, r = comm.size, comm.rank

    def make():
        model = make_model()
        model.compile(optimizer=hk.DistributedOptimizer(optimizer(), **wrapper), loss=LOSS)
        return model

    def run(model, steps):
        for s in steps:
            x, y = global_batch(s, n)
            model.train_on_batch(x[r * B:(r + 1) * B], y[r * B:(r + 1) * B])

    straight = make()
    run(straight, range(6))
    model = make()
    run(model, range(3))
    with CheckpointManager(ckdir, comm=comm, verify_replicas="error") as manager:
        manager.save(3, {"model": model, "optimizer": model.optimizer})
    fresh = make()
    fresh.set_weights([w + 1 for w in fresh.get_weights()])
    fresh.optimizer.build(fresh.trainable_variables)
    assert CheckpointManager(ckdir, comm=comm).restore({"model": fresh, "optimizer": fresh.optimizer}) == 3
    run(fresh, range(3, 6))
    for got, want in zip(fresh.get_weights(), straight.get_weights()):
        np.testing.assert_array_equal(got, want)



@pytest.mark.share_counts
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gradient_tape_loop_matches_single_process_with_n_times_the_batch(comm, name, graph):
    n, r = comm.size, comm.rank
    model, ref = make_model(seed=r), make_model()          # replicas start different: broadcast fixes it
    opt, ref_opt = OPTIMIZERS[name](), OPTIMIZERS[name]()
    htf.broadcast_variables(model.variables, root=0)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        grads = htf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    def ref_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, ref(x, training=True))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref.trainable_variables), ref.trainable_variables))

    if graph:
        step, ref_step = tf.function(step), tf.function(ref_step)
    for s in range(STEPS):
        x, y = global_batch(s, n)
        step(x[r * B:(r + 1) * B], y[r * B:(r + 1) * B])
        ref_step(x, y)
        assert_identical_across_ranks(comm, model.variables, f"after step {s}")
    assert_close(model.trainable_variables, ref.trainable_variables, n)


class _Identical(keras.callbacks.Callback):
    def __init__(self, comm):
        super().__init__()
        self.comm, self.steps = comm, 0

    def on_train_batch_end(self, batch, logs=None):
        assert_identical_across_ranks(self.comm, self.model.variables, f"after batch {batch}")
        self.steps += 1


def fit_both(comm, model, ref, steps):
    """``model.fit`` on this rank's B rows of ``steps`` global batches (rank 0's variables broadcast first, replicas
    checked identical after every batch), ``ref.fit`` on the N*B rows at once; returns the batches checked."""
    n, r = comm.size, comm.rank
    parts = [global_batch(s, n) for s in range(steps)]
    mine = (np.concatenate([x[r * B:(r + 1) * B] for x, _ in parts]),
            np.concatenate([y[r * B:(r + 1) * B] for _, y in parts]))
    everything = (np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts]))
    check = _Identical(comm)
    model.fit(tf.data.Dataset.from_tensor_slices(mine).batch(B), epochs=1, verbose=0,
              callbacks=[hk.BroadcastGlobalVariablesCallback(0), check])
    ref.fit(tf.data.Dataset.from_tensor_slices(everything).batch(n * B), epochs=1, verbose=0)
    return check.steps


@pytest.mark.share_counts
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras_fit_matches_single_process_with_n_times_the_batch(comm, name):
    n, r = comm.size, comm.rank
    model, ref = make_model(seed=r), make_model()
    model.compile(optimizer=hk.DistributedOptimizer(OPTIMIZERS[name]()), loss=LOSS)
    ref.compile(optimizer=OPTIMIZERS[name](), loss=LOSS)
    assert fit_both(comm, model, ref, STEPS) == STEPS
    assert type(model.optimizer).__name__.startswith("Distributed")
    assert_close(model.trainable_variables, ref.trainable_variables, n)


@pytest.mark.share_counts
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_keras_fit_with_backward_passes_per_step_matches_keras_own_accumulation_of_the_whole_batch(comm, name):
    """k passes summed locally, one reduction: the same updates as one process with Keras's own
    gradient_accumulation_steps=k on the ranks' batches concatenated (the reference reduces nothing)."""
    n, r, k = comm.size, comm.rank, 2
    model, ref = make_model(seed=r), make_model()
    opt = hk.DistributedOptimizer(OPTIMIZERS[name](), backward_passes_per_step=k)
    model.compile(optimizer=opt, loss=LOSS)
    reference_opt = OPTIMIZERS[name]()
    reference_opt.gradient_accumulation_steps = k
    ref.compile(optimizer=reference_opt, loss=LOSS)
    passes = STEPS // 2 * k + 1                     # (the last round is left half-way)
    assert fit_both(comm, model, ref, passes) == passes
    assert int(opt.iterations.numpy()) == int(reference_opt.iterations.numpy()) == passes // k     # (updates)
    assert_close(model.trainable_variables, ref.trainable_variables, n)
    sums = [v for v in opt.variables if "hpctrain_agg_sum" in v.path]     # (the half-way round, checkpointed)
    assert len(sums) == len(model.trainable_variables) and any(np.any(v.numpy() != 0) for v in sums)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 both accumulate"):
        hk.DistributedOptimizer(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2), backward_passes_per_step=2)


def test_a_checkpoint_half_way_through_backward_passes_per_step_resumes_bit_for_bit(comm, ckdir):
    """Each rank's partial sums are its own optimizer variables: saved after 3 passes (k=2, half-way) and restored
    into a fresh model and optimizer, the run ends bit for bit where the unbroken one does; into a plain optimizer,
    or half-way at another size, it is refused in one line."""
    from hpctrain.checkpoint import CheckpointError, CheckpointManager

    n = comm.size
    resumes_bit_for_bit(comm, ckdir, lambda: keras.optimizers.Adam(0.01), backward_passes_per_step=2)
    plain = make_model()            # into an optimizer without the sums: refused in one line
    plain.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=LOSS)
    plain.optimizer.build(plain.trainable_variables)
    with pytest.raises(CheckpointError, match=r"ValueError: the checkpoint has \d+ optimizer variables"):
        CheckpointManager(ckdir, comm=comm).restore({"model": plain, "optimizer": plain.optimizer})
    alone = comm.split(0 if comm.rank == 0 else None)
    if n > 1 and alone is not None:     # (half-way through a round at another size: refused in one line)
        other = make_model()
        other.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2,
                                                        comm=alone), loss=LOSS)
        other.optimizer.build(other.trainable_variables)
        with pytest.raises(CheckpointError, match=rf"1 pass\(es\) into a round of backward_passes_per_step=2 at "
                                                  rf"{n} ranks: its partial sums resume only at {n} ranks, not 1"):
            CheckpointManager(ckdir, comm=alone).restore({"model": other, "optimizer": other.optimizer})


def test_broadcast_makes_replicas_and_optimizer_state_identical(comm):
    r = comm.rank
    model = make_model(seed=r)
    opt = keras.optimizers.Adam(0.01)
    x, y = global_batch(r, 1)          # a different local step per rank: different Adam moments
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    before = comm.allgather_object(flat(model.variables + opt.variables).tolist())
    assert comm.size == 1 or before[0] != before[1]          # the test starts from different replicas
    htf.broadcast_variables(model.variables + opt.variables, root=0)
    assert_identical_across_ranks(comm, model.variables + opt.variables)
    assert flat(model.variables + opt.variables).tolist() == before[0]


def test_broadcast_of_different_variables_fails_on_every_rank_naming_them(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    v = [tf.Variable(tf.zeros((2, 3 if comm.rank == comm.size - 1 else 2)))]
    with pytest.raises(ValueError, match=rf"rank.*{comm.size - 1}"):
        htf.broadcast_variables(v, root=0)


def test_sparse_gradients_gathered_or_densified_equal_the_dense_average(comm):
    n, r = comm.size, comm.rank
    table = tf.Variable(tf.reshape(tf.range(40, dtype=tf.float32), (10, 4)))
    ids = tf.constant([r % 10, (3 * r + 1) % 10, 7])

    def grads(sparse_as_dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.nn.embedding_lookup(table, ids) * float(r + 1))
        g = htf.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient(loss, [table])[0]
        return g

    g = grads(False)
    assert isinstance(g, tf.IndexedSlices)
    want = np.zeros((10, 4))
    for q in range(n):
        for i in (q % 10, (3 * q + 1) % 10, 7):
            want[i] += (q + 1) / n
    np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), want, rtol=1e-6)
    dense = grads(True)
    assert not isinstance(dense, tf.IndexedSlices)
    np.testing.assert_allclose(dense.numpy(), want, rtol=1e-6)
    opt = keras.optimizers.SGD(1.0)          # the gathered slices apply as the averaged dense gradient
    before = table.numpy().copy()
    opt.apply_gradients([(g, table)])
    np.testing.assert_allclose(table.numpy(), before - want, rtol=1e-6)


def test_allreduce_eager_and_in_tf_function(comm):
    n, r = comm.size, comm.rank
    x = tf.constant([float(r), 2.0 * r + 1])
    want = np.array([sum(range(n)), sum(2.0 * q + 1 for q in range(n))]) / n
    np.testing.assert_allclose(htf.allreduce(x, op="avg").numpy(), want)
    np.testing.assert_allclose(tf.function(lambda t: htf.allreduce(t, op="avg"))(x).numpy(), want)
    assert htf.allreduce(x).numpy()[0] == sum(range(n))         # every collective sums by default


def test_xla_refused_with_a_clear_error(comm):
    @tf.function(jit_compile=True)
    def f(t):
        return htf.allreduce(t)

    with pytest.raises(RuntimeError, match="jit_compile=False"):
        f(tf.constant([1.0]))


def test_metric_average_callback_and_average_metrics(comm):
    n, r = comm.size, comm.rank
    logs = {"loss": float(r), "accuracy": np.float32(2 * r)}
    hk.MetricAverageCallback().on_epoch_end(0, logs)
    assert logs["loss"] == pytest.approx(sum(range(n)) / n) and logs["accuracy"] == pytest.approx(n - 1)
    got = htf.average_metrics({"x": tf.constant(float(r))})
    assert got["x"] == pytest.approx((n - 1) / 2)


def test_learning_rate_warmup_follows_the_formula(comm):
    n = comm.size
    model = make_model()
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss=LOSS)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    x, y = global_batch(0, 1, per_rank=16)
    warm = hk.LearningRateWarmupCallback(0.4, warmup_epochs=2, steps_per_epoch=4)
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[warm, Record()])
    want = [0.4 / n * ((e + b / 4) * (n - 1) / 2 + 1) for e in range(2) for b in range(4)] + [0.4] * 4
    np.testing.assert_allclose(seen, want, rtol=1e-6)


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_distributed_dataset_follows_the_sampler_split(comm, drop_remainder):
    n, r = comm.size, comm.rank
    num, batch, seed = 23, 3, 5
    data = (np.arange(num) * 10, np.arange(num).astype(np.float32))
    ds = htf.distributed_dataset(data, batch, seed=seed, drop_remainder=drop_remainder)
    sampler = DistributedSampler(num, seed=seed)           # the torch side's split
    for epoch in range(2):
        order = np.random.default_rng(seed + epoch).permutation(num)        # the documented formula
        order = np.concatenate([order, order[:-num % n]]) if num % n else order
        mine = order[r::n]
        sampler.set_epoch(epoch)
        assert sampler.indices() == mine.tolist()
        want = [mine[i:i + batch] for i in range(0, len(mine), batch)]
        if drop_remainder:
            want = [w for w in want if len(w) == batch]
        got = [(a.numpy(), b.numpy()) for a, b in ds]
        assert len(got) == len(want) == int(ds.cardinality())
        for (a, b), w in zip(got, want):
            np.testing.assert_array_equal(a, w * 10)
            np.testing.assert_array_equal(b, w.astype(np.float32))


def adasum_replicas(start, make_model, make_opt, per_step, loss_fn):
    """Horovod's Adasum optimizer simulated in one process: n replicas from the same ``start`` weights, each with
    its own optimizer, steps on its own batch (``per_step[s][q]`` is rank q's (x, y) at step s); the weight deltas
    are combined tensor by tensor (numpy Adasum) and every replica takes the result.  Returns the final weights."""
    from hpctrain.collectives.adasum import adasum_reference
    n = len(per_step[0])
    models = [make_model() for _ in range(n)]
    opts = [make_opt() for _ in range(n)]
    for m in models:
        m.set_weights(start)
    for batches_of_ranks in per_step:
        before = models[0].get_weights()
        deltas = []
        for m, opt, (x, y) in zip(models, opts, batches_of_ranks):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, m(x))
            opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
            deltas.append([w - b for w, b in zip(m.get_weights(), before)])
        if n > 1:
            new = [b + adasum_reference([d[i] for d in deltas]) for i, b in enumerate(before)]
            for m in models:
                m.set_weights(new)
    return models[0].get_weights()


def test_keras_fit_with_adasum_combines_the_ranks_updates(comm):
    n, r = comm.size, comm.rank
    make_opt = lambda: keras.optimizers.SGD(0.1, momentum=0.9)      # noqa: E731  (momentum stays per rank)
    model = make_model()
    model.compile(optimizer=hk.DistributedOptimizer(make_opt(), op="adasum"), loss=LOSS)
    steps = 4
    parts = [global_batch(s, n) for s in range(steps)]
    mine = (np.concatenate([x[r * B:(r + 1) * B] for x, _ in parts]),
            np.concatenate([y[r * B:(r + 1) * B] for _, y in parts]))
    start = make_model().get_weights()
    check = _Identical(comm)
    model.fit(tf.data.Dataset.from_tensor_slices(mine).batch(B), epochs=1, verbose=0, callbacks=[check],
              shuffle=False)
    per_step = [[(x[q * B:(q + 1) * B], y[q * B:(q + 1) * B]) for q in range(n)] for x, y in parts]
    want = adasum_replicas(start, make_model, make_opt, per_step, LOSS)
    for a, b in zip(model.get_weights(), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert check.steps == steps


def test_keras_adasum_keeps_each_ranks_momentum_through_a_checkpoint(comm, ckdir):
    """op='adasum': each rank's momentum is its own; saved after 3 steps and restored into a fresh model and
    optimizer, the run ends bit for bit where the unbroken one does."""
    resumes_bit_for_bit(comm, ckdir, lambda: keras.optimizers.SGD(0.1, momentum=0.9), op="adasum")
