"""The public facade: documented, quiet at import, a size-1 world without a launcher, clear errors."""
import inspect
import subprocess
import sys

import numpy as np
import pytest

import hpctrain
from hpctrain.collectives.ops import segment_bounds
from hpctrain.comm.call.signature import Call, judge
from hpctrain.errors import format_ranks

from harness import base_env


def public_objects():
    import hpctrain.collectives.ops as ops
    import hpctrain.collectives.ring as ring
    import hpctrain.env as env
    import hpctrain.launcher.launch as launch
    import hpctrain.horovod.basics as hvd_basics
    import hpctrain.horovod.keras as hvd_keras
    import hpctrain.horovod.tensorflow as hvd_tf
    import hpctrain.horovod.tensorflow.keras as hvd_tf_keras
    import hpctrain.horovod.torch as hvd_torch
    import hpctrain.tensors as tensors

    for module in (hpctrain, ops, ring, env, launch, tensors, hvd_basics, hvd_torch, hvd_tf, hvd_tf_keras, hvd_keras,
                   hvd_tf_keras.callbacks):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or inspect.isclass(obj):
                yield f"{module.__name__}.{name}", obj
                if inspect.isclass(obj):
                    for mname, member in vars(obj).items():
                        if not mname.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                            yield f"{module.__name__}.{name}.{mname}", member


def test_every_public_object_has_a_docstring():
    missing = [name for name, obj in public_objects() if not (inspect.getdoc(obj) or "").strip()]
    assert not missing, f"public objects without a docstring: {missing}"


def test_import_is_quiet_and_framework_free():
    code = ("import sys, hpctrain; bad = [m for m in ('torch', 'tensorflow', 'mpi4py', 'horovod') if m in sys.modules];"
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "" and out.stderr == ""


def test_ml_dtypes_waits_for_the_first_bfloat16_and_every_other_dtype_is_unchanged_before_it():
    """ml_dtypes (about a second of import) is loaded by the first bfloat16 tensor, not by hpctrain; before it,
    float64 and float32 sums come back in their dtype and values (numpy reads ``dtype == None`` as float64's test,
    once the cause of float64 results read as bfloat16), and torch's bfloat16 then goes through."""
    code = """
import sys, numpy as np, torch, hpctrain
comm = hpctrain.init("local")
for dt in (torch.float64, torch.float32, torch.int64):
    x = torch.arange(5, dtype=dt) * 3
    out = comm.allreduce(x, op="sum")
    assert out.dtype == dt and torch.equal(out, x), (dt, out)
assert np.array_equal(comm.allreduce(np.linspace(0, 1, 7)), np.linspace(0, 1, 7))
assert "ml_dtypes" not in sys.modules
b = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
out = comm.allreduce(b, op="sum")
assert out.dtype == torch.bfloat16 and torch.equal(out, b) and "ml_dtypes" in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("module", ["hpctrain.horovod.torch", "hpctrain.horovod.tensorflow",
                                    "hpctrain.horovod.tensorflow.keras", "hpctrain.horovod.keras",
                                    "hpctrain.horovod.common.util"])
def test_each_horovod_module_imports_first(module):
    """Each of Horovod's module names works as the first import of a process (no import cycle)."""
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                         env=base_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def test_plain_python_is_a_world_of_one():
    code = "import hpctrain as h; c = h.init(); print(h.size(), h.rank(), c.backend)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "0", "local"]


def test_local_world_collectives_and_lifecycle():
    hpctrain.shutdown()
    with pytest.raises(hpctrain.NotInitializedError):
        hpctrain.rank()
    comm = hpctrain.init("local")
    assert hpctrain.init() is comm and hpctrain.is_initialized()
    with pytest.raises(ValueError, match="already initialised"):
        hpctrain.init("mpi")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(hpctrain.allreduce(x, op="avg"), x)
    np.testing.assert_array_equal(hpctrain.reduce_scatter(x), x)
    hpctrain.send(x, dest=0, tag=3)
    np.testing.assert_array_equal(hpctrain.recv(source=0, tag=3), x)
    with pytest.raises(RuntimeError, match="wait forever"):
        hpctrain.recv(source=0, tag=4)
    with pytest.raises(ValueError, match="root"):
        hpctrain.broadcast(x, root=1)
    hpctrain.shutdown()
    assert not hpctrain.is_initialized()
    with pytest.raises(ValueError, match="unknown backend"):
        hpctrain.init("nccl")


def test_world_hooks_run_in_order_and_forget_a_dropped_owner():
    import gc

    class Owner:
        pass

    hpctrain.shutdown()
    comm = hpctrain.init("local")
    ran = []
    kept, dropped = Owner(), Owner()
    comm.on_close(lambda: ran.append("first"), "first")
    comm.on_close(lambda owner: ran.append(("kept", owner is kept)), "kept", owner=kept)
    comm.on_close(lambda owner: ran.append("dropped"), "dropped", owner=dropped)
    remove = comm.on_close(lambda: ran.append("removed"), "removed")
    comm.on_interrupt(lambda owner: "a note", owner=dropped)
    comm.on_interrupt(lambda: "the step saved")
    assert len(comm.life.interrupt_notes()) == 2
    del dropped
    gc.collect()
    remove()
    assert [note() for note in comm.life.interrupt_notes()] == ["the step saved"]
    before, server = comm.life.failure_policy, Owner()
    told = []
    comm.on_rank_failure(lambda owner, failed: told.append((owner is server, failed)), owner=server)
    tolerating = comm.life.failure_policy
    assert tolerating is not before and not tolerating.reforms
    tolerating.handler([3])          # (what the watchdog does when rank 3 is known to have failed)
    assert told == [(True, [3])]
    del server
    gc.collect()
    assert comm.life.failure_policy is before          # (the owner dropped: the policy before is back)
    hpctrain.shutdown()
    assert ran == [("kept", True), "first"]          # last added first; the dropped and removed ones never ran


def test_bucket_strategies_are_found_by_name_refuse_compression_in_one_line_and_survive_a_rebuild():
    import torch

    from hpctrain.bucket_strategies import strategy_for
    from hpctrain.comm.call.handle import done_handle
    from hpctrain.gradients import GradientAverager
    from hpctrain.torch import DistributedOptimizer
    from hpctrain.torch.optimizer import rebuild_on

    hpctrain.shutdown()
    comm = hpctrain.init("local")
    with pytest.raises(ValueError, match="unknown bucket strategy 'ring'; expected one of allreduce, local_sgd"):
        strategy_for("ring")
    with pytest.raises(ValueError, match="'reduce_scatter' bucket strategy reduces buckets its own way"):
        GradientAverager(comm, "avg", "fp16", bucket_strategy="reduce_scatter")
    calls = []

    def doubling(comm, flat, bucket, names, shapes, op):      # a strategy of the program's own
        calls.append(bucket.index)
        flat.mul_(2)
        return done_handle(flat)
    with pytest.raises(ValueError, match="'doubling' bucket strategy reduces buckets its own way"):
        GradientAverager(comm, "avg", "fp16", bucket_strategy=doubling)
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model.named_parameters(),
                               bucket_strategy=doubling)
    rebuild_on(opt, comm, ("avg", None, None, False), 1, 2 ** 20)        # (what following a re-formed world does)
    sync = opt._hpctrain          # (a world of one sends nothing in step(): the bucket is started by hand)
    flat = torch.arange(sync.buckets[0].numel + 2, dtype=torch.float32)
    reduced = sync.averager.start_bucket(flat, sync.buckets[0], sync.names, sync.shapes).wait()
    assert calls == [0]
    torch.testing.assert_close(reduced, 2 * torch.arange(sync.buckets[0].numel + 2, dtype=torch.float32))
    hpctrain.shutdown()


def test_both_communicator_kinds_state_the_feature_protocol_without_probes():
    from hpctrain.comm.base import Communicator
    from hpctrain.comm.protocol import CAPABILITIES, FeatureComm
    from hpctrain.horovod.negotiated import NegotiatedComm

    def stated(obj, name):          # (set on the object or declared on its class, not found by a __getattr__)
        return name in getattr(obj, "__dict__", {}) or any(name in vars(k) for k in type(obj).__mro__)

    hpctrain.shutdown()
    comm = hpctrain.init("local")
    assert isinstance(comm, FeatureComm) and isinstance(comm, Communicator)
    hpctrain.shutdown()
    assert not [name for name in CAPABILITIES if not stated(comm, name)]
    missing = [name for name in CAPABILITIES if not any(name in vars(k) for k in NegotiatedComm.__mro__)]
    assert not missing, f"NegotiatedComm does not state {missing}"


def test_segment_bounds_match_array_split():
    for count in (0, 1, 2, 5, 7, 1000003):
        for parts in (1, 2, 3, 4):
            sizes = [len(a) for a in np.array_split(np.empty(count), parts)]
            assert np.diff(segment_bounds(count, parts)).tolist() == sizes


def test_mismatch_message_lists_every_rank():
    calls = [Call("allreduce", 3, "float32", (4,), op="sum"), Call("allreduce", 3, "float32", (4,), op="sum"),
             Call("allreduce", 3, "float32", (5,), op="sum"), Call("allgather", 3, "float32", (4,))]
    msg = judge([c.encode() for c in calls], "world", 3)
    assert "ranks 0-1: allreduce(float32[4], op=sum)" in msg
    assert "rank 2: allreduce(float32[5], op=sum)" in msg and "rank 3: allgather(float32[4])" in msg
    same = [Call("allgather", 1, "int64", (r + 1, 2), free_dim0=True).encode() for r in range(3)]
    assert judge(same, "world", 1) == ""  # dim 0 may differ for allgather
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_cross_memory_copies_spans_end_to_end_and_names_the_process_it_cannot_reach():
    """process_vm_readv/writev through CrossMemory (on this process itself): spans in order, clear errors."""
    import os

    from hpctrain.comm.backends.mpi.cross_memory import CrossMemory
    from hpctrain.collectives.flat import Flat

    xm = CrossMemory()
    a, b = np.arange(10, dtype=np.float64), np.arange(100, 107, dtype=np.float64)
    flat = Flat([a, b])
    got = np.zeros(6)
    xm.read(os.getpid(), flat.byte_spans(flat.spans(7, 13), flat.addresses()), got)      # 3 of a, then 3 of b
    assert got.tolist() == [7, 8, 9, 100, 101, 102]
    xm.write(os.getpid(), flat.byte_spans(flat.spans(8, 11), flat.addresses()), np.array([-1.0, -2.0, -3.0]))
    assert a[8:].tolist() == [-1, -2] and b[:2].tolist() == [-3, 101]
    many = [(a.ctypes.data + 8 * (k % 10), 8) for k in range(2500)]              # more spans than one call takes
    out = np.zeros(2500)
    xm.read(os.getpid(), many, out)
    assert out.tolist() == [a[k % 10] for k in range(2500)]
    with pytest.raises(ValueError, match="16 bytes of spans for a.* 48 bytes"):
        xm.read(os.getpid(), [(a.ctypes.data, 16)], np.zeros(6))
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()                                                                  # reaped: no such process now
    with pytest.raises(OSError, match=f"cannot read from process {child.pid}: No such process"):
        xm.read(child.pid, [(a.ctypes.data, 8)], np.zeros(1))


def test_the_c_kernel_was_built_and_refuses_bad_buffers():
    """The set-up builds the mailbox's C kernel (setup.py); a build that silently failed would cost ~3 µs a call."""
    from hpctrain.comm.backends.mpi import _mailbox_kernel

    slots = np.zeros((2, 2, 256), np.uint8)          # (slot, rank, bytes): header 64 + payload 192 here
    addrs = [slots[s, r].ctypes.data for s in range(2) for r in range(2)]
    kernel = _mailbox_kernel.Kernel(0, 2, 128, 0, 0, addrs, [a + 64 for a in addrs])
    x, out = np.ones(8, np.float32), np.empty(8, np.float32)
    with pytest.raises(ValueError, match="same bytes"):
        kernel.allreduce(1, 5, 0, x, np.empty(9, np.float32), 0)
    with pytest.raises(ValueError, match="dtype code"):
        kernel.allreduce(1, 5, 0, x, out, 9)
    with pytest.raises(ValueError, match="2 \\* size addresses"):
        _mailbox_kernel.Kernel(0, 2, 128, 0, 0, addrs[:3], addrs)
    assert kernel.allreduce(1, 5, 0, x, out, 0) == 2               # rank 1 has not posted exchange 1
    peer = slots[1, 1, :64].view(np.int64)
    peer[1:3] = 5, 32
    slots[1, 1, 64:96].view(np.float32)[:] = 2.5
    peer[0] = 1                                                    # now it has: 1 + 2.5 each
    assert kernel.reduce(1, 5, out, 0) == 0 and out.tolist() == [3.5] * 8
    peer[1] = 6                                                    # another call's hash
    assert kernel.reduce(1, 5, out, 0) == 1


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_the_half_precision_sum_kernel_gives_numpys_bits_for_every_16_bit_value(kind):
    """The C sums of float16 and bfloat16 (hpctrain/_half_kernel.c, built by the set-up) equal numpy's
    loops bit for bit: each of the 65536 bit patterns against a shuffled partner and against each of the special
    values (zeros, subnormals, the largest finite, inf, NaN only as NaN), in place too; bad buffers are refused;
    and the casts from and to float32 equal numpy's ``astype``."""
    from hpctrain import _half_kernel
    from hpctrain.half import narrow, widen
    from hpctrain.collectives.ops import pairwise
    from hpctrain.tensors import BFLOAT16

    dtype = np.dtype(np.float16) if kind == "float16" else BFLOAT16
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)
    special = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00,
                        0x7F7F, 0xFF7F, 0x7F80, 0x0080, 0x007F, 0x3C00, 0x3F80], dtype=np.uint16).view(dtype)
    partners = [np.random.default_rng(3).permutation(every)] + [np.full(every.size, s, dtype) for s in special]
    add = pairwise("sum", dtype)
    assert add is not np.add, "the kernel was not built"
    for b in partners:
        with np.errstate(over="ignore", invalid="ignore"):
            want, got = np.add(every, b), np.empty_like(every)
        add(every, b, out=got)
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
        inplace = every.copy()
        add(inplace, b, out=inplace)
        assert np.array_equal(inplace.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    with pytest.raises(ValueError, match="same even number of bytes"):
        _half_kernel.add(np.zeros(3, np.uint16), np.zeros(4, np.uint16), np.zeros(4, np.uint16), False)
    # the casts (the fp16 and bf16 compressors): every 16-bit value to float32 and back, and float32 values
    # around every rounding boundary, subnormal and overflowing ones among them, to the 16-bit type
    wide, nan = widen(every), np.isnan(every.astype(np.float32))      # (a NaN stays a NaN, maybe quieted)
    assert np.array_equal(np.isnan(wide), nan)
    assert np.array_equal(wide.view(np.uint32)[~nan], every.astype(np.float32).view(np.uint32)[~nan])
    wide = np.concatenate([every.astype(np.float32)[~nan][:, None]
                           * np.float32([1, 1 + 2 ** -12, 1 - 2 ** -12, 1 + 2 ** -9, 1 + 2 ** -20])]).reshape(-1)
    wide = np.concatenate([wide, np.random.default_rng(4).standard_normal(100_003).astype(np.float32) * 1e3,
                           np.float32([65519.99, 65520, 2.0 ** -25, 2.0 ** -25 * 1.0001, 3e38, np.inf])])
    with np.errstate(over="ignore"):
        want = wide.astype(dtype)
    assert np.array_equal(narrow(wide, dtype).view(np.uint16), want.view(np.uint16))
