"""hpctrain.horovod.tensorflow and .keras behave as Horovod's API promises, against numpy and one-process references.

Runs at 1-4 ranks after test_horovod_api.py, last in the default launch (the
negotiation thread must be the only issuer of collectives while ``hvd`` is
initialised).
References: numpy on every rank's input (each rank rebuilds the others'
inputs from the seed), central differences of a global loss for gradients,
and plain TensorFlow/Keras training in this one process on the concatenated
batch for the gradient tape and the optimizers (Keras 3, and Keras 2 from
the tf-keras package).
"""
import os

import numpy as np
import pytest
import tensorflow as tf

import hpctrain.horovod.tensorflow as hvd
import hpctrain.horovod.tensorflow.keras as hvd_keras


pytestmark = pytest.mark.usefixtures("horovod_api")


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float16, np.float32, np.float64])
def test_allreduce_ops_and_scale_factors(dtype, inputs):
    low = 0 if np.dtype(dtype).kind == "u" else -50
    xs = inputs((5, 3), dtype, seed=1, low=low, high=4 if dtype == np.uint8 else 50)
    x = tf.constant(xs[hvd.rank()])
    stack = np.stack(xs)
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Sum).numpy(), stack.sum(0, dtype=dtype))
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Min).numpy(), stack.min(0))
    np.testing.assert_array_equal(hvd.allreduce(x, op=hvd.Max).numpy(), stack.max(0))
    avg = hvd.allreduce(x).numpy()                  # Average is the default of hvd.allreduce
    if np.dtype(dtype).kind in "iu":
        np.testing.assert_array_equal(avg, np.trunc(stack.sum(0).astype(np.float64) / hvd.size()).astype(dtype))
    else:      # (whole numbers: float16 sums exact, the mean within one float16 rounding of the float64 one)
        np.testing.assert_allclose(avg, stack.astype(np.float64).mean(0), rtol=1e-3 if dtype == np.float16 else 1e-6)
    got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0).numpy()
    if np.dtype(dtype).kind == "f":
        np.testing.assert_allclose(got, stack.astype(np.float64).sum(0) * 1.5, rtol=1e-3)
    outs = hvd.grouped_allreduce([x, tf.constant([hvd.rank()], tf.int64)], op=hvd.Sum)
    np.testing.assert_array_equal(outs[0].numpy(), stack.sum(0, dtype=dtype))
    assert outs[1].numpy().tolist() == [sum(range(hvd.size()))]


def session_run(build):
    """Build ops in a TF1 graph and run them in a session."""
    with tf.Graph().as_default():
        fetches = build()
        with tf.compat.v1.Session() as sess:
            return sess.run(fetches)


def test_ops_inside_tf_function_and_a_tf1_session():
    r, n = hvd.rank(), hvd.size()

    def build(x):
        return (hvd.allreduce(x, op=hvd.Sum), hvd.allgather(x[: r + 1]), hvd.broadcast(x, root_rank=n - 1),
                hvd.size_op(), hvd.rank_op())
    x = np.full(n + 1, r + 1, np.float32)
    want = [np.full(n + 1, n * (n + 1) / 2), np.concatenate([np.full(k + 1, k + 1.0) for k in range(n)]),
            np.full(n + 1, float(n)), n, r]
    for got in (tf.function(build)(tf.constant(x)), session_run(lambda: build(tf.constant(x)))):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)


def test_a_tf1_session_runs_more_independent_collectives_than_the_pool_had_threads():
    """Each graph collective holds an inter-op thread while it waits for the other ranks, and the ranks start
    independent ones in their own orders; with TensorFlow's default pool (one thread per core) 24 of them in
    one ``session.run`` wait on each other. Importing hpctrain's TensorFlow modules gave the pool room."""
    r, n, k = hvd.rank(), hvd.size(), 24
    assert int(os.environ["TF_NUM_INTEROP_THREADS"]) >= k

    def build():
        outs = []
        for i in range(k):     # some work of its own before each collective, as a model's layers have
            x = tf.reduce_sum(tf.random.uniform((200 + 50 * ((i * 7 + r) % 5), 64), seed=i), axis=0) * 0.0
            outs.append(hvd.allreduce(x + float(i + r), op=hvd.Sum, name=f"independent.{i}"))
        return outs
    for i, got in enumerate(session_run(build)):
        np.testing.assert_array_equal(got, np.full(64, float(n * i + n * (n - 1) // 2), np.float32))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_indexed_slices_are_gathered_into_the_reduced_gradient(op):
    r, n = hvd.rank(), hvd.size()
    rows = [np.random.default_rng(10 + k).standard_normal((2, 3)).astype(np.float32) for k in range(n)]
    slices = tf.IndexedSlices(tf.constant(rows[r]), tf.constant([r, r + 1]), dense_shape=tf.constant([n + 1, 3]))
    out = hvd.allreduce(slices, op=hvd.Sum if op == "sum" else hvd.Average)
    assert isinstance(out, tf.IndexedSlices)
    want = np.zeros((n + 1, 3))
    for k in range(n):
        want[[k, k + 1]] += rows[k]
    np.testing.assert_allclose(tf.convert_to_tensor(out).numpy(), want / (n if op == "avg" else 1), rtol=1e-5)
    with pytest.raises(NotImplementedError, match="Sum and Average"):
        hvd.allreduce(slices, op=hvd.Max)


def test_allgather_broadcast_alltoall_reducescatter(inputs):
    r, n = hvd.rank(), hvd.size()
    parts = [np.full((k % 3 + 1, 2), k, np.float32) for k in range(n)]
    np.testing.assert_array_equal(hvd.allgather(tf.constant(parts[r])).numpy(), np.concatenate(parts))
    g1, g2 = hvd.grouped_allgather([tf.constant(parts[r]), tf.constant([r])])
    assert g2.numpy().tolist() == list(range(n))
    for root in range(n):
        assert hvd.broadcast(tf.constant([r, 2 * r]), root).numpy().tolist() == [root, 2 * root]
    v = tf.Variable([float(r)] * 2)
    hvd.broadcast_variables([v], root_rank=n - 1)
    assert v.numpy().tolist() == [n - 1.0] * 2
    splits = [(r + k) % 2 + 1 for k in range(n)]      # rank r sends splits[k] rows to rank k
    send = tf.constant([10 * r + k for k, s in enumerate(splits) for _ in range(s)])
    got, received = hvd.alltoall(send, splits=tf.constant(splits, tf.int32))
    assert received.numpy().tolist() == [(k + r) % 2 + 1 for k in range(n)]
    assert got.numpy().tolist() == [10 * k + r for k in range(n) for _ in range((k + r) % 2 + 1)]
    xs = inputs((2 * n + 1, 3), np.float32, seed=4)
    mine = hvd.reducescatter(tf.constant(xs[r]), op=hvd.Sum).numpy()
    np.testing.assert_allclose(mine, np.array_split(np.sum(xs, 0), n)[r], rtol=1e-6)
    assert hvd.broadcast_object({"r": r}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(r) == list(range(n))


def test_errors_are_tensorflows_on_every_rank():
    r, n = hvd.rank(), hvd.size()
    bad_everywhere = [lambda: hvd.alltoall(tf.ones([2]), splits=[3] * n), lambda: hvd.reducescatter(tf.constant(1.0))]
    for case in bad_everywhere:
        with pytest.raises(tf.errors.InvalidArgumentError, match="the same on every rank"):
            case()
    if n > 1:
        def mismatch():
            return hvd.allreduce(tf.ones([3 + (r == 1)]))
        for run in (mismatch, tf.function(mismatch), lambda: session_run(mismatch)):
            with pytest.raises(tf.errors.FailedPreconditionError) as info:
                run()
            assert "rank 1" in str(info.value) or run is not mismatch
        texts = hvd.allgather_object("ok")
        assert texts == ["ok"] * n
    assert hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist() == [n] * 2      # still in step


def global_loss(fn, x, weights, scale):
    """scale * sum over ranks of <weights, fn(x)>: the same number on every rank."""
    local = float(tf.reduce_sum(fn(tf.constant(x)) * weights))
    return scale * float(hvd.allreduce(tf.constant([local], tf.float64), op=hvd.Sum)[0])


# (collective, loss scale): each gradient convention is the derivative of scale * (sum of the ranks' losses)
GRADIENT_CASES = {
    "allreduce_sum": (lambda x: hvd.allreduce(x, op=hvd.Sum), lambda n: 1.0),
    "allreduce_avg": (lambda x: hvd.allreduce(x), lambda n: 1.0),
    "grouped_allreduce": (lambda x: hvd.grouped_allreduce([x, 2 * x], op=hvd.Sum)[1], lambda n: 1.0),
    "allgather": (lambda x: hvd.allgather(x), lambda n: 1.0 / n),
    "broadcast": (lambda x: hvd.broadcast(x, root_rank=hvd.size() - 1), lambda n: 1.0 / n),
    "alltoall": (lambda x: hvd.alltoall(x), lambda n: 1.0),
    "reducescatter_sum": (lambda x: hvd.reducescatter(x, op=hvd.Sum), lambda n: float(n)),
    "reducescatter_avg": (lambda x: hvd.reducescatter(x, op=hvd.Average), lambda n: float(n)),
}


@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_gradients_equal_finite_differences(case):
    fn, scale_of = GRADIENT_CASES[case]
    n, r = hvd.size(), hvd.rank()
    scale = scale_of(n)
    xs = [np.random.default_rng(7).standard_normal((n, 2)) for _ in range(n)]
    x = tf.Variable(xs[r])
    with tf.GradientTape() as tape:
        y = fn(x)
        weights = tf.constant(np.random.default_rng(100 + r).standard_normal(tuple(y.shape)))
        loss = tf.reduce_sum(y * weights)
    grad = tape.gradient(loss, x).numpy()
    eps, bad = 1e-6, []
    for q in range(n):
        for i in range(xs[0].size):
            bumped = []
            for sign in (1, -1):
                xb = xs[r].copy()
                if r == q:
                    xb.flat[i] += sign * eps
                bumped.append(global_loss(fn, xb, weights, scale))
            fd = (bumped[0] - bumped[1]) / (2 * eps)
            if r == q and not abs(fd - grad.flat[i]) < 1e-6 * max(1.0, abs(fd)):
                bad.append((i, fd, grad.flat[i]))
    assert not bad, f"{case}: (element, finite difference, tape) on rank {r}: {bad}"


# -- training against one process on the concatenated batch ------------------------------------
def batches(steps, per_rank=4):
    """Every step's global batch (x, y), the same on every rank; rank r trains on rows r::n of it."""
    g = np.random.default_rng(3)
    n = hvd.size()
    return [(g.standard_normal((per_rank * n, 3)).astype(np.float32),
             g.standard_normal((per_rank * n, 2)).astype(np.float32)) for _ in range(steps)]


def mine(batch):
    x, y = batch
    return x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]


def dense_model(keras, seed=0):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    g = np.random.default_rng(seed + hvd.rank())             # every rank starts elsewhere: broadcast fixes it
    model.set_weights([g.standard_normal(w.shape).astype(np.float32) for w in model.get_weights()])
    return model


def reference_weights(keras, data, lr, steps_per_update=1):
    """One process: the same model from rank 0's start, SGD on each whole global batch (mean loss)."""
    ref = dense_model(keras)
    start = hvd.broadcast_object(ref.get_weights(), root_rank=0)
    ref.set_weights(start)
    opt = keras.optimizers.SGD(lr)
    for k in range(0, len(data), steps_per_update):
        group = data[k:k + steps_per_update]
        grads = None
        for x, y in group:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(ref(x) - y))
            g = tape.gradient(loss, ref.trainable_variables)
            grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        opt.apply_gradients(zip([gr / len(group) for gr in grads], ref.trainable_variables))
    return ref.get_weights()


def assert_weights_close(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_distributed_gradient_tape_in_tf_function_equals_one_process():
    import keras
    data = batches(3)
    model = dense_model(keras)
    hvd.broadcast_variables(model.variables, root_rank=0)
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    for batch in data:
        step(*map(tf.constant, mine(batch)))
    assert_weights_close(model.get_weights(), reference_weights(keras, data, 0.1))


@pytest.mark.share_counts
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
def test_fit_with_distributed_optimizer_equals_one_process(keras_name):
    """Keras 3 and Keras 2 (tf-keras): model.fit with hvd.DistributedOptimizer and the broadcast callback."""
    keras = __import__(keras_name)
    data = batches(3)
    model = dense_model(keras)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=opt, loss="mse")
    if keras_name == "keras":
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                     hvd_keras.callbacks.MetricAverageCallback()]
    else:                                           # Keras 2: broadcast by hand (its callbacks need tf.keras = 2)
        hvd.broadcast_variables(model.variables, root_rank=0)
        callbacks = []
    x = np.concatenate([mine(b)[0] for b in data])
    y = np.concatenate([mine(b)[1] for b in data])
    hist = model.fit(x, y, batch_size=len(x) // len(data), epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
    assert_weights_close(model.get_weights(), reference_weights(keras, data, 0.1))
    if callbacks:                                   # the averaged loss is the same number on every rank
        assert len(set(hvd.allgather_object(hist.history["loss"][0]))) == 1


@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
def test_backward_passes_per_step_apply_every_kth_pass(keras_name):
    keras = __import__(keras_name)
    data = batches(4)
    model = dense_model(keras)
    hvd.broadcast_variables(model.variables, root_rank=0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                                   average_aggregated_gradients=True)
    for batch in data:
        x, y = mine(batch)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    assert int(opt.iterations.numpy()) == len(data)
    assert int(opt._agg_helper.counter.numpy()) == 0
    assert_weights_close(model.get_weights(), reference_weights(keras, data, 0.1, steps_per_update=2))


def test_partial_tape_keeps_local_gradients_divided_by_the_ranks():
    import keras
    n = hvd.size()
    model = dense_model(keras, seed=20)
    x, y = mine(batches(1)[0])
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    local = tape.gradient(loss, model.trainable_variables)
    dist = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[0]])
    got = dist.gradient(loss, model.trainable_variables)
    for g, own in zip(got[:2], local[:2]):                  # the first layer's kernel and bias stay local
        np.testing.assert_allclose(g.numpy(), own.numpy() / n, rtol=1e-6)
    for g, own in zip(got[2:], local[2:]):                  # the rest: averaged over the ranks
        np.testing.assert_allclose(g.numpy(), hvd.allreduce(own).numpy(), rtol=1e-6)


def test_sync_batch_norm_uses_the_global_batch():
    import keras
    n, r = hvd.size(), hvd.rank()
    full = np.random.default_rng(5).standard_normal((2 * n, 3)).astype(np.float32) * 3 + 1
    ref = keras.layers.BatchNormalization(momentum=0.5)
    want = ref(full, training=True).numpy()
    sync = hvd.SyncBatchNormalization(momentum=0.5)
    got = sync(full[2 * r:2 * r + 2], training=True).numpy()
    np.testing.assert_allclose(got, want[2 * r:2 * r + 2], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(sync.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(sync.moving_variance.numpy(), ref.moving_variance.numpy(), rtol=1e-5)


def test_load_model_wraps_the_saved_optimizer_again(tmp_path_factory):
    import keras
    model = dense_model(keras)
    hvd.broadcast_variables(model.variables, root_rank=0)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    x, y = mine(batches(1)[0])
    model.fit(x, y, epochs=1, verbose=0)
    path = os.path.join(str(tmp_path_factory.mktemp(f"rank{hvd.rank()}")), "model.keras")
    model.save(path)
    loaded = hvd_keras.load_model(path)
    opt = loaded.optimizer
    assert type(opt).__name__ == "Adam" and type(opt).__module__ == "hpctrain.horovod.keras_optimizer"
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.01)
    loaded.fit(x, y, epochs=1, verbose=0)                   # the loaded optimizer reduces over the ranks
    assert len({w.tobytes() for w in hvd.allgather_object(loaded.get_weights()[0])}) == 1


@pytest.mark.share_counts
@pytest.mark.parametrize("keras_name", ["keras", "tf_keras"])
def test_fit_with_adasum_optimizer_combines_the_ranks_updates(keras_name):
    """``hvd.DistributedOptimizer(op=hvd.Adasum)`` in model.fit: each rank's SGD-with-momentum step, then Adasum of
    the weight deltas (the reference: the ranks simulated in one process, numpy Adasum per tensor)."""
    from test_tf_training import adasum_replicas
    keras = __import__(keras_name)
    data = batches(3)
    model = dense_model(keras)
    hvd.broadcast_variables(model.variables, root_rank=0)
    start = model.get_weights()
    make_opt = lambda: keras.optimizers.SGD(0.1, momentum=0.9)     # noqa: E731
    model.compile(optimizer=hvd.DistributedOptimizer(make_opt(), op=hvd.Adasum), loss="mse")
    x = np.concatenate([mine(b)[0] for b in data])
    y = np.concatenate([mine(b)[1] for b in data])
    model.fit(x, y, batch_size=len(x) // len(data), epochs=1, shuffle=False, verbose=0)
    n = hvd.size()
    per_step = [[(bx[q::n], by[q::n]) for q in range(n)] for bx, by in data]
    want = adasum_replicas(start, lambda: dense_model(keras), make_opt, per_step,
                           lambda t, p: tf.reduce_mean(tf.square(p - t)))
    assert_weights_close(model.get_weights(), want)
    assert len(set(hvd.allgather_object(b"".join(w.tobytes() for w in model.get_weights())))) == 1


def test_gradient_tape_with_adasum_combines_gradients():
    """``DistributedGradientTape(op=hvd.Adasum)`` combines the gradients; with plain SGD that is the same step
    as combining the updates (Adasum does not change under scaling), so the same reference holds."""
    import keras
    from test_tf_training import adasum_replicas
    data = batches(3)
    model = dense_model(keras)
    hvd.broadcast_variables(model.variables, root_rank=0)
    start = model.get_weights()
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        grads = hvd.DistributedGradientTape(tape, op=hvd.Adasum).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    for batch in data:
        step(*map(tf.constant, mine(batch)))
    n = hvd.size()
    per_step = [[(bx[q::n], by[q::n]) for q in range(n)] for bx, by in data]
    want = adasum_replicas(start, lambda: dense_model(keras), lambda: keras.optimizers.SGD(0.1), per_step,
                           lambda t, p: tf.reduce_mean(tf.square(p - t)))
    assert_weights_close(model.get_weights(), want)


def test_tf1_optimizer_with_adasum_in_a_session_combines_the_deltas():
    """``hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(...), op=hvd.Adasum)`` in a TF1 session:
    Horovod's delta optimizer (the reference: the ranks simulated with Keras' SGD with momentum, which takes
    the same step)."""
    import keras
    from test_tf_training import adasum_replicas
    data = batches(3)
    n = hvd.size()
    start = hvd.broadcast_object(dense_model(keras).get_weights(), root_rank=0)

    def build():
        ws = [tf.compat.v1.Variable(w) for w in start]
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), op=hvd.Adasum)
        x, y = tf.compat.v1.placeholder(tf.float32, (None, 3)), tf.compat.v1.placeholder(tf.float32, (None, 2))
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, ws[0]) + ws[1]), ws[2]) + ws[3] - y))
        return ws, x, y, opt.minimize(loss, var_list=ws)

    with tf.Graph().as_default():
        ws, x, y, train = build()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for batch in data:
                bx, by = mine(batch)
                sess.run(train, {x: bx, y: by})
            got = sess.run(ws)
    per_step = [[(bx[q::n], by[q::n]) for q in range(n)] for bx, by in data]
    want = adasum_replicas(start, lambda: dense_model(keras), lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                           per_step, lambda t, p: tf.reduce_mean(tf.square(p - t)))
    assert_weights_close(got, want)
