"""What the collective tests on ranks share: each rank's deterministic input and the numpy references.

Each rank can compute every other rank's input (``data(rank, ...)`` is
deterministic), so the reference is computed locally with numpy.  Inputs are
small integers stored in each dtype: sums, products, minima and maxima of
them are exact in every dtype and every summation order, so results must
match the reference exactly, and the ``avg`` reference divides the exact sum
the same way.
"""
import hashlib
import os

import numpy as np

from hpctrain.tensors import BFLOAT16

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64, np.int32, np.int64, np.uint8, np.bool_]
OPS = ["sum", "avg", "min", "max", "prod"]
SIZES = ["0", "1", "n-1", "1000003"]
BIG = 64 << 20  # 64 MiB
SHARED_LARGE_COUNTS = (2, 3, 4)


def skip_unless_large_pair_runs_here(size, dtype, op):
    """Skip a million-value case whose (dtype, op) pair is not this launch's share (CI time, CONTRIBUTING).

    Every dtype with ``sum`` and every op in float32 run at every rank count; each other pair runs at one of
    the counts 2-4 (pair index mod 3), not at 1, where every algorithm's large path is a copy; at other counts
    every pair runs.  The small sizes run every pair everywhere.
    """
    import pytest
    from hpctrain.env import detect_launcher

    if size != "1000003" or op == "sum" or np.dtype(dtype) == np.float32:
        return
    launch = detect_launcher()
    n = launch.size if launch else 1
    pair = DTYPES.index(dtype) * len(OPS) + OPS.index(op)
    at = [c for c in SHARED_LARGE_COUNTS if pair % len(SHARED_LARGE_COUNTS) == c - SHARED_LARGE_COUNTS[0]]
    if n == 1 or (n in SHARED_LARGE_COUNTS and n not in at):
        pytest.skip(f"million-value pairs other than sum or float32 share the rank counts: this one runs at {at}")


def data(rank, count, dtype, op="sum", seed=0, shape=None):
    """Return rank's deterministic input: small integers chosen so every reduction is exact."""
    rng = np.random.default_rng([seed, rank, count])
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        v = rng.integers(0, 2, count).astype(bool)
    elif op == "prod":
        v = rng.choice(np.array([1, 2] if dtype.kind == "u" else [-2, -1, 1, 2]), count)
    elif dtype.kind == "u":
        v = rng.integers(0, 60, count)
    else:
        v = rng.integers(-30, 31, count)
    v = np.asarray(v).astype(dtype)
    return v.reshape(shape) if shape is not None else v


def acc_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(np.float16), BFLOAT16):
        return np.float32
    return np.uint8 if dtype == np.bool_ else dtype


def reference(inputs, op, n):
    dtype = inputs[0].dtype
    stack = np.stack([x.astype(acc_dtype(dtype)) for x in inputs])
    if op in ("sum", "avg"):
        out = stack.sum(axis=0, dtype=stack.dtype)
    elif op == "prod":
        out = stack.prod(axis=0, dtype=stack.dtype)
    else:
        out = stack.min(axis=0) if op == "min" else stack.max(axis=0)
    if op == "avg":
        out = out / out.dtype.type(n)
    return out.astype(dtype)


def valid(dtype, op):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return op in ("min", "max")
    return not (op == "avg" and dtype.kind in "iu")


def same_on_all_ranks(comm, arr):
    digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    return len(set(comm.allgather_object(digest))) == 1


def algorithms(comm, elements: int = 0):
    """Every allreduce algorithm that can run on this launch ("shm" needs one node); for inputs of more than
    2^17 ``elements`` not "doubling" (made for small buffers, the same code at every size: CI time)."""
    return [a for a in comm.allreduce_algorithms() if not (a == "shm" and comm.topology.num_nodes > 1)
            and not (a == "doubling" and elements > 1 << 17)]


def rows_of(rank, rows, dtype, width=3, seed=1):
    return data(rank, rows * width, dtype, seed=seed, shape=(rows, width))


def summed(n, count, dtype, shape=None):
    """:func:`reference`'s exact sum of every rank's :func:`data`, one input at a time (no stack of n copies)."""
    total = data(0, count, dtype, shape=shape)
    for r in range(1, n):
        total += data(r, count, dtype, shape=shape)
    return total


def group_of(rank, seed=0):
    """A gradient-like list: mixed sizes (some empty, some over a fusion buffer), dtypes and shapes."""
    specs = [((3, 4), np.float32), ((0,), np.float32), ((1000,), np.float16), ((7,), np.int64),
             ((300_000,), np.float32), ((2, 3, 5), np.float64), ((1,), np.float32), ((40_000, 10), np.float32),
             ((5,), BFLOAT16), ((2,), np.float16)]
    out = []
    for i, (shape, dtype) in enumerate(specs):
        count = int(np.prod(shape))
        out.append(data(rank, count, dtype, seed=seed + i, shape=shape))
    return out


def repeat_expected(comm):
    """Whether repeated small all-reduces of ``comm`` take the repeat path (MPI on one node, or one rank)."""
    return comm.size == 1 or getattr(comm._backend, "_mailbox", None) is not None


def uses_c_kernel(comm, x, op):
    """Whether the repeated all-reduce of ``x`` by ``op`` runs in the mailbox's C kernel."""
    mb = getattr(comm._backend, "_mailbox", None)
    return mb is not None and mb.sum_code(x.dtype, op) is not None


def ordered_sum(inputs, op, n):
    """x_0 + x_1 + ... added left to right in numpy (then / n for avg): the order every algorithm keeps."""
    out = inputs[0].copy()
    for x in inputs[1:]:
        out = np.add(out, x)
    return out / out.dtype.type(n) if op == "avg" else out


def direct_copies_expected(comm):
    """Whether large one-node all-reduces of ``comm`` should copy straight between ranks' memory.

    The MPI backend on one node with more than one rank, unless HPCTRAIN_CROSS_MEMORY=0:
    this machine's kernel allows process_vm_readv between one user's processes.
    """
    return (comm.backend == "mpi" and comm.size > 1 and comm.topology.num_nodes == 1
            and not getattr(comm._backend, "_no_windows", "") and os.environ.get("HPCTRAIN_CROSS_MEMORY") != "0")
