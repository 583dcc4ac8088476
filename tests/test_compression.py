"""Compressors on one process: round trips, unbiasedness, error feedback, PowerSGD, registry and state.

The multi-rank aggregation is in tests/ranks/test_compression.py; training with
each compressor in tests/ranks/test_compression_training.py.
"""
import numpy as np
import pytest

import hpctrain.compression as C
from hpctrain.compression.base import Slot
from hpctrain.compression.reducer import pack_payloads, unpack_payloads


def round_trip(comp, x, slot=None):
    slot = slot or Slot("t", x.shape)
    payload, ctx = comp.compress(x, slot)
    return payload, comp.decompress(payload, ctx, x.size)


def test_fp16_is_exact_on_representable_values_and_halves_the_bytes():
    x = np.array([0, 1, -2.5, 1024, 6.103515625e-05, -65504, 0.333251953125], dtype=np.float32)
    payload, got = round_trip(C.get("fp16"), x)
    np.testing.assert_array_equal(got, x)
    assert payload[0].dtype == np.float16 and payload[0].nbytes * 2 == x.nbytes


def test_bf16_is_exact_on_representable_values():
    x = np.array([0, 1, -2.5, 2.0 ** 127, 2.0 ** -100, 0.1015625], dtype=np.float32)
    payload, got = round_trip(C.get("bf16"), x)
    np.testing.assert_array_equal(got, x)
    assert payload[0].nbytes * 2 == x.nbytes


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    rng = np.random.default_rng(0)
    x = rng.permutation(np.arange(1, 1001, dtype=np.float32)) * rng.choice([-1, 1], 1000).astype(np.float32)
    payload, got = round_trip(C.get("topk", ratio=0.013), x)
    k = 13
    want = np.where(np.abs(x) > 1000 - k, x, 0)       # magnitudes are 1..1000, all distinct
    np.testing.assert_array_equal(got, want)
    assert payload[0].size == k and payload[1].dtype == np.uint16   # n <= 65536: 2-byte indices


def test_threshold_sends_what_crosses_tau():
    x = np.array([0.5, -2.0, 1.0, -0.99, 3.0], dtype=np.float32)
    _, got = round_trip(C.get("threshold", tau=1.0), x)
    np.testing.assert_array_equal(got, [0, -2.0, 1.0, 0, 3.0])


@pytest.mark.parametrize("name, kwargs", [("randomk", {"ratio": 0.25}), ("qsgd", {"levels": 4}),
                                          ("terngrad", {})])
def test_stochastic_compressors_are_unbiased(name, kwargs):
    """Mean of T independent decompressions versus x, coordinate by coordinate, in standard errors.

    Each coordinate's error divided by its standard error (sample sd / sqrt(T))
    is approximately N(0, 1); over 64 coordinates the largest |z| exceeds 5 with
    probability about 64 * 6e-7.  The seed is fixed, so the test is
    deterministic; a bias of 2% of a coordinate (an off-by-one level, a missing
    n/k scale) gives |z| in the tens.
    """
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    comp = C.get(name, seed=7, **kwargs)
    slot = Slot("w", x.shape)
    T = 20000
    samples = np.empty((T, x.size))
    for t in range(T):
        slot.step = t
        samples[t] = round_trip(comp, x, slot)[1]
    mean, se = samples.mean(0), samples.std(0, ddof=1) / np.sqrt(T)
    z = np.abs(mean - x) / np.maximum(se, 1e-12)
    assert z.max() < 5, f"{name}: largest z-score {z.max():.2f} (coordinate {z.argmax()})"
    assert se.max() > 0, "the samples never varied: the randomness is not used"


@pytest.mark.parametrize("name, kwargs", [("topk", {"ratio": 0.1}), ("threshold", {"tau": 0.8}),
                                          ("randomk", {"ratio": 0.1, "error_feedback": True}),
                                          ("efsignsgd", {}), ("onebit", {}), ("fp16", {"error_feedback": True})])
def test_error_feedback_conserves_mass(name, kwargs):
    """sent + new residual = compensated input, each step; over steps sum(sent) + residual = sum(inputs)."""
    comp = C.get(name, **kwargs)
    rng = np.random.default_rng(2)
    slot = comp.slot("w", (500,), 0)
    inputs, sent_total = np.zeros(500, np.float64), np.zeros(500, np.float64)
    for step in range(5):
        g = rng.standard_normal(500).astype(np.float32)
        c = comp.compensate(g, slot)
        payload, ctx = comp.compress(c, slot)
        sent = comp.decompress(payload, ctx, c.size)
        comp.remember(c, sent, slot)
        slot.step += 1
        np.testing.assert_allclose(sent + slot.arrays["residual"], c, rtol=0, atol=1e-6)
        inputs += g
        sent_total += sent
        assert not np.array_equal(sent, c), "nothing was compressed away"
    np.testing.assert_allclose(sent_total + slot.arrays["residual"], inputs, rtol=0, atol=1e-5)


def test_dgc_momentum_correction_and_masking():
    """DGC: u <- m u + g, v <- v + u; the top-k of v is sent and zeroed in u and v (sent + v' = v + u)."""
    comp = C.get("dgc", ratio=0.1, momentum=0.5)
    slot = comp.slot("w", (100,), 0)
    rng = np.random.default_rng(3)
    u_ref, v_ref = np.zeros(100, np.float32), np.zeros(100, np.float32)
    for _ in range(4):
        g = rng.standard_normal(100).astype(np.float32)
        u_ref = 0.5 * u_ref + g
        v_ref = v_ref + u_ref
        payload, ctx = comp.compress(g, slot)
        sent = comp.decompress(payload, ctx, 100)
        slot.step += 1
        top = np.argsort(-np.abs(v_ref))[:10]
        np.testing.assert_allclose(sent[top], v_ref[top], rtol=1e-6)
        assert np.count_nonzero(sent) == 10
        v_ref[top] = 0
        u_ref[top] = 0
        np.testing.assert_allclose(slot.arrays["v"], v_ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(slot.arrays["u"], u_ref, rtol=1e-6, atol=1e-6)


def test_dgc_warmup_density_goes_from_a_quarter_to_the_ratio():
    comp = C.get("dgc", ratio=0.001, warmup_steps=4)
    d = [comp.density(s) for s in range(6)]
    assert d[0] == pytest.approx(0.25) and d[4] == d[5] == 0.001
    assert all(a > b for a, b in zip(d[:4], d[1:5]))


def test_signsgd_majority_vote_and_onebit_means():
    comp = C.get("signsgd")
    signs = [round_trip(comp, np.array(v, np.float32))[1] for v in ([1, -2, 3, -0.0], [-1, -1, 2, 5], [2, 3, -1, -2])]
    np.testing.assert_array_equal(comp.finish(np.sum(signs, axis=0), 3, "avg"), [1, -1, 1, 1])
    x = np.array([1.0, 3.0, -2.0, -4.0, 0.0], np.float32)
    _, got = round_trip(C.get("onebit"), x)
    np.testing.assert_allclose(got, [4 / 3, 4 / 3, -3, -3, 4 / 3], rtol=1e-6)
    _, got = round_trip(C.get("efsignsgd"), x)
    np.testing.assert_allclose(got, np.array([1, 1, -1, -1, 1]) * 2.0, rtol=1e-6)


def test_powersgd_at_full_rank_reproduces_the_matrix_and_is_cheaper_at_low_rank():
    from hpctrain.comm.backends.local import init_world
    from hpctrain.comm.life.runtime import Config

    comm = init_world(Config.from_env())      # a world of one: the reduction is the identity
    m = np.random.default_rng(4).standard_normal((12, 5)).astype(np.float32)
    full = C.CompressedReducer(C.get("powersgd", rank=5, start_iter=0, min_compression_rate=0),
                               comm, C.Policy(min_numel=0))
    got = m.copy()
    full.reduce([("w", got)])
    np.testing.assert_allclose(got, m, rtol=1e-4, atol=1e-5)
    low = C.CompressedReducer(C.get("powersgd", rank=1, start_iter=0), comm, C.Policy(min_numel=0))
    a = np.outer(np.arange(1, 41), np.arange(1, 31)).astype(np.float32)   # rank 1: exact at rank 1
    got = a.copy()
    low.reduce([("w", got)])
    np.testing.assert_allclose(got, a, rtol=1e-4)
    low.count_step()
    assert low.stats()["sent_bytes_per_step"] == 4 * (40 + 30)


def test_powersgd_views_conv_kernels_of_both_frameworks_as_the_same_matrix():
    comp = C.get("powersgd", rank=2, start_iter=0)
    assert comp.matrix_shape((16, 1, 3, 3)) == (16, 9)          # PyTorch conv: out x in kh kw
    assert comp.matrix_shape((3, 3, 1, 16)) == (9, 16)          # Keras conv: kh kw in x out
    assert comp.matrix_shape((3, 3, 16, 32)) == (144, 32)
    assert comp.matrix_shape((40, 30)) == (40, 30) and comp.matrix_shape((7,)) == (7, 0)
    assert comp.matrix_shape((0, 0)) == (0, 0) and not comp.compresses((0, 0), step=0)
    # 9 x 16 at rank 2 compresses 144 values to 50; the first-dimension view (3 x 48) would not pass rate 2
    assert comp.compresses((3, 3, 1, 16), step=0) and comp.compresses((16, 1, 3, 3), step=0)


def test_pack_unpack_round_trip_with_every_wire_dtype():
    rng = np.random.default_rng(5)
    payloads = [[rng.standard_normal(3).astype(np.float32), np.arange(5, dtype=np.int32)],
                [np.packbits([1, 0, 1]), np.array([-3, 4], np.int8)],
                [np.zeros(0, np.float16), np.arange(7, dtype=np.int64), np.array([300], np.int16),
                 np.array([65535], np.uint16)]]
    buf = pack_payloads(payloads)
    got, used = unpack_payloads(np.concatenate([buf, buf]), [2, 2, 4])
    assert used == buf.size and buf.size % 8 == 0
    for want, have in zip(payloads, got):
        for w, h in zip(want, have):
            assert w.dtype == h.dtype
            np.testing.assert_array_equal(w, h)


def test_casts_take_every_tensor_so_fp16_is_exactly_half():
    from hpctrain.comm.backends.local import init_world
    from hpctrain.comm.life.runtime import Config

    reducer = C.CompressedReducer(C.get("fp16"), init_world(Config.from_env()))
    reducer.reduce([("fc.bias", np.ones(10, np.float32)), ("w", np.ones((3, 3), np.float32))])
    reducer.count_step()
    assert reducer.stats()["ratio_to_fp32"] == 0.5


def test_policy_keeps_biases_norms_and_small_tensors_dense():
    p = C.Policy()
    assert p.compress("layer1.weight", 4096)
    assert not p.compress("layer1.bias", 4096)
    assert not p.compress("bn1.weight", 4096) and not p.compress("LayerNorm.weight", 4096)
    assert not p.compress("fc.weight", 100)
    assert C.Policy(min_numel=0, only=["*attn*"]).compress("attn.w", 1)
    assert not C.Policy(min_numel=0, only=["*attn*"]).compress("mlp.w", 1)


def test_registry_and_bad_arguments_give_clear_errors():
    assert set(C.names()) >= {"none", "fp16", "bf16", "topk", "randomk", "threshold", "dgc", "qsgd", "terngrad",
                              "signsgd", "efsignsgd", "onebit", "powersgd"}
    with pytest.raises(ValueError, match="unknown compressor 'zip'"):
        C.get("zip")
    with pytest.raises(ValueError, match="ratio must be in"):
        C.get("topk", ratio=0)
    with pytest.raises(TypeError, match="compressor 'topk'"):
        C.get("topk", rank=3)
    with pytest.raises(ValueError, match="levels"):
        C.get("qsgd", levels=0)


def test_state_dict_round_trip_restores_residuals_and_steps():
    a = C.get("topk", ratio=0.1)
    slot = a.slot("w", (50,), 0)
    x = np.random.default_rng(6).standard_normal(50).astype(np.float32)
    c = a.compensate(x, slot)
    p, ctx = a.compress(c, slot)
    a.remember(c, a.decompress(p, ctx, 50), slot)
    slot.step = 3
    b = C.get("topk", ratio=0.1)
    b.load_state_dict(a.state_dict())
    assert b.slots["w"].step == 3 and b.slots["w"].shape == (50,)
    np.testing.assert_array_equal(b.slots["w"].arrays["residual"], slot.arrays["residual"])
    with pytest.raises(ValueError, match="belongs to compressor 'topk'"):
        C.get("dgc").load_state_dict(a.state_dict())
