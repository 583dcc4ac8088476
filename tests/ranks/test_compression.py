"""Compressed reduction over N ranks equals decompress-then-average computed with numpy.

Every rank knows every rank's gradients (seeded by step and rank), so it
recomputes each rank's payload with a compressor of its own (same arguments,
that rank's number) and averages the decompressed buffers in numpy; the
reduction over the ranks must match it, and all ranks must hold the same
bits.  Three steps run, so error-feedback residuals, step-seeded randomness and
PowerSGD's warm start all take part.  Tolerances: float32 sums in rank order
are reproduced exactly (1e-6 relative slack); fp16/bf16 payloads travel as
2-byte values, each hop's pair added in float32 and rounded to the wire
format, so the result may differ from the numpy mean by ``n - 1`` roundings
(hpctrain.collectives.ops' bound: ``u`` = 2^-11, 2^-8 of the magnitudes'
sum), taken here as ``2 (n - 1) u`` relative to the largest value.
"""
import hashlib
import time

import numpy as np
import pytest

import hpctrain.compression as C
from hpctrain.compression.base import Slot

SHAPES = {"layer.weight": (40, 30), "conv.weight": (8, 4, 3, 3), "vec": (1000,), "fc.bias": (10,)}
CASES = {
    "none": {}, "fp16": {}, "bf16": {}, "topk": {"ratio": 0.05}, "randomk": {"ratio": 0.1},
    "threshold": {"tau": 1.5}, "dgc": {"ratio": 0.05, "momentum": 0.9, "clip_norm": 20.0, "warmup_steps": 2},
    "qsgd": {"levels": 8}, "terngrad": {}, "signsgd": {}, "efsignsgd": {}, "onebit": {},
    "powersgd": {"rank": 2, "start_iter": 1},
}
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def tolerance(name, n, otherwise):
    """The relative error allowed for compressor ``name`` over ``n`` ranks (module docstring)."""
    return 2 * max(n - 1, 1) * UNIT[name] if name in UNIT else otherwise


def grads(step, rank):
    rng = np.random.default_rng([step, rank])
    return {k: (rng.standard_normal(s) * (1 + rank)).astype(np.float32) for k, s in SHAPES.items()}


def reference_standard(comps, policy, step, n, name):
    """numpy: each rank's compensate -> compress -> decompress, then the mean (or the vote) over ranks."""
    out = {}
    for key, shape in SHAPES.items():
        per_rank = [grads(step, r)[key].reshape(-1) for r in range(n)]
        if name == "none" or not policy.compress(key, int(np.prod(shape))):
            out[key] = np.sum(per_rank, axis=0, dtype=np.float32) / np.float32(n)
            continue
        sent = []
        for r, comp in enumerate(comps):
            slot = comp.slot(key, shape, r)
            c = comp.compensate(per_rank[r], slot)
            payload, ctx = comp.compress(c, slot)
            s = comp.decompress(payload, ctx, c.size)
            comp.remember(c, s, slot)
            slot.step += 1
            sent.append(s)
        total = np.zeros_like(sent[0])
        for s in sent:
            total += s
        out[key] = np.sign(total) if name == "signsgd" else total / np.float32(n)
    return out


def reference_powersgd(state, step, n, rank, start_iter):
    """numpy PowerSGD from the paper's formulas: P = sum C_i Q; P = qr(P); Q = mean C_i^T P; M = P Q^T."""
    out = {}
    for key, shape in SHAPES.items():
        per_rank = [grads(step, r)[key] for r in range(n)]
        if len(shape) < 2 or step < start_iter:
            out[key] = np.mean(per_rank, axis=0, dtype=np.float64).reshape(-1)
            continue
        mats = [g.reshape(shape[0], -1).astype(np.float64) + state["e"][key][r] for r, g in enumerate(per_rank)]
        rows, cols = mats[0].shape
        r_ = min(rank, rows, cols)
        if rows * cols < 2.0 * r_ * (rows + cols):
            out[key] = np.mean(per_rank, axis=0, dtype=np.float64).reshape(-1)
            continue
        q = state["q"].get(key)
        if q is None:
            q = Slot(key, shape, step=step).rng(0, shared=True).standard_normal(cols * r_, dtype=np.float32)
            q = q.reshape(cols, r_).astype(np.float64)
        p, _ = np.linalg.qr(sum(m @ q for m in mats))
        q = sum(m.T @ p for m in mats) / n
        approx = p @ q.T
        state["q"][key] = q
        for r in range(n):
            state["e"][key][r] = mats[r] - approx
        out[key] = approx.reshape(-1)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_compressed_reduction_equals_numpy_decompress_then_average(comm, name):
    n, me = comm.size, comm.rank
    policy = C.Policy(min_numel=0)                  # compress all but the bias (name pattern)
    reducer = C.CompressedReducer(C.get(name, **CASES[name]), comm, policy)
    comps = [C.get(name, **CASES[name]) for _ in range(n)]
    state = {"q": {}, "e": {k: [0.0] * n for k in SHAPES}}
    for step in range(3):
        mine = grads(step, me)
        entries = [(k, v.copy()) for k, v in mine.items()]
        reducer.reduce(entries, op="avg")
        reducer.count_step()
        if name == "powersgd":
            want = reference_powersgd(state, step, n, CASES[name]["rank"], CASES[name]["start_iter"])
        else:
            want = reference_standard(comps, policy, step, n, name)
        for key, got in entries:
            w = want[key]
            scale = max(float(np.abs(w).max()), 1e-30)
            err = float(np.abs(got.reshape(-1) - w).max()) / scale
            tol = tolerance(name, n, 1e-4 if name == "powersgd" else 1e-6)
            assert err <= tol, f"{name} step {step} {key}: relative error {err:.3g} > {tol}"
        digest = hashlib.sha256(b"".join(a.tobytes() for _, a in entries)).hexdigest()
        digests = comm.allgather_object(digest)
        assert len(set(digests)) == 1, f"{name} step {step}: ranks hold different results {digests}"
    stats = reducer.stats()
    assert stats["steps"] == 3 and stats["dense_bytes_per_step"] == 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    most = {"topk": 0.6, "signsgd": 0.6, "onebit": 0.6, "qsgd": 0.6, "fp16": 0.6,
            "powersgd": 0.8}            # powersgd: step 0 is exact (start_iter=1)
    if name in most:
        assert stats["ratio_to_fp32"] < most[name], stats


@pytest.mark.parametrize("name", ["fp16", "powersgd"])
def test_a_compressed_reduction_in_flight_is_a_waitable_that_honours_a_timeout(comm, name):
    """What a compressed bucket's handle is (``CompressedReducer.start``) follows the Waitable protocol: while the
    last rank has not started, ``test()`` is false and ``wait(timeout)`` raises TimeoutError with the reduction still
    in flight; waited again it gives the numpy reference (PowerSGD: its exchange, then its second all-reduce)."""
    from hpctrain.comm.call.handle import Waitable

    n, me = comm.size, comm.rank
    args = {"rank": 2, "start_iter": 0} if name == "powersgd" else {}
    policy = C.Policy(min_numel=0)
    reducer = C.CompressedReducer(C.get(name, **args), comm, policy)
    if me == n - 1:
        time.sleep(0.5)
    entries = [(k, v.copy()) for k, v in grads(0, me).items()]
    pending = reducer.start(entries, op="avg")
    assert isinstance(pending, Waitable), type(pending)
    if n > 1 and me < n - 1:
        assert not pending.test()
        with pytest.raises(TimeoutError):
            pending.wait(timeout=0.05)
    got = pending.wait(timeout=60)
    assert pending.test() and [a is e for a, (_, e) in zip(got, entries)] == [True] * len(entries)
    if name == "powersgd":
        want = reference_powersgd({"q": {}, "e": {k: [0.0] * n for k in SHAPES}}, 0, n, 2, 0)
    else:
        want = reference_standard([C.get(name) for _ in range(n)], policy, 0, n, name)
    for key, a in entries:
        w = want[key]
        err = float(np.abs(a.reshape(-1) - w).max()) / max(float(np.abs(w).max()), 1e-30)
        assert err <= tolerance(name, n, 1e-4), f"{name} {key}: relative error {err:.3g}"


def test_compressed_reduction_refuses_bad_input_on_every_rank(comm):
    reducer = C.CompressedReducer(C.get("topk"), comm)
    with pytest.raises(ValueError, match="op 'avg' or 'sum'"):
        reducer.start([("w", np.zeros(4, np.float32))], op="max")
    with pytest.raises(TypeError, match="writable C-contiguous"):
        reducer.start([("w", np.zeros((4, 4), np.float32)[:, 0])])
    with pytest.raises(TypeError, match="hpctrain.compression compressor"):
        C.CompressedReducer("topk", comm)
