"""The call check of a one-node communicator as one write and one read of shared memory, with small inputs carried along.

Each rank of the node owns two *slots* (used alternately, call after call) in
an MPI-3 shared window.  A slot holds a flag, a 64-bit hash of the call's key,
the encoded call (``DESC_BYTES``) and up to ``capacity`` bytes of payload.
One exchange (:meth:`Mailbox.exchange`):

1. the rank writes its hash, call and payload into slot ``k % 2``, a memory
   barrier (``MPI_Win_sync``), then the flag ``k`` (the exchange's number);
2. it waits until every peer's flag in that slot has reached ``k`` (spinning,
   then yielding the core, so oversubscribed ranks still progress), a memory
   barrier;
3. it compares every rank's hash with its own.  Every rank reads every call,
   so on a mismatch every rank builds the same message from them, with no
   second round.

Alternating slots make one wait per exchange enough: a rank writes slot
``k % 2`` again at exchange ``k + 2``, only after every peer has posted
exchange ``k + 1``, which each does after it finished reading exchange ``k``.
A payload therefore stays readable until the owner's next exchange, which is
what an all-reduce of a small buffer needs: the inputs are there once the
check passes, and each rank reduces them itself (see
:func:`hpctrain.collectives.shm.shm_allreduce_small`).

:meth:`Mailbox.sum_small` is the exchange and the sum of the payloads in one
call of a small C extension (``_mailbox_kernel.c``, built when a compiler is
there), for the float32/float64/int32/int64 sums a training loop repeats
(metrics, losses, small gradients); same protocol, same bits, and no Python
between posting the call and the reduced result.

Cost per exchange: one write of the call and payload, one memory barrier, ``n``
flag reads per poll, ``n`` hash reads; against a gather to rank 0 and a reply
(``2 (n - 1)`` MPI messages and two hops) for communicators that span nodes.
"""
from __future__ import annotations

import os
import time
from typing import Callable, List, Optional

import numpy as np

from .node import release_window, shared_window
from ...call.signature import DESC_BYTES

try:
    from . import _mailbox_kernel
except ImportError:                   # (built without a C compiler: the Python exchange does it all)
    _mailbox_kernel = None

__all__ = ["Mailbox"]

_HEADER = 64                          # flag, hash, payload bytes, call bytes (int64 each), padding
_SPINS = 50                           # polls (about 20 µs) before yielding the core, when each rank has one
_SLEEP_AFTER_S = 0.01                 # after this long, sleep between polls (a peer is far behind)
_SPIN_NS = 20_000                     # the C kernel's polls, when each rank has a core ...
_YIELD_NS = 1_000_000                 # ... and its wait yielding the core, before it hands the wait to Python
_KERNEL_SUMS = {np.dtype(t): code for code, t in enumerate((np.float32, np.float64, np.int32, np.int64))}


def cores_per_rank_at_least_one(local_size: int) -> bool:
    """Guess whether each local rank has a core of its own (a rank bound to one core is assumed to have it)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:                # (not Linux)
        cores = os.cpu_count() or 1
    return cores == 1 or cores >= local_size


class Mailbox:
    """Two slots per local rank in one shared window (collective over ``node`` to create and to free).

    Args:
        node: the MPI communicator of the ranks (all on one node).
        MPI: the mpi4py module.
        capacity: the most payload bytes a slot holds.
        progress: called while a wait runs past the first polls, to let the MPI library move
            other messages on (a rank waiting here makes no MPI call otherwise, and a peer's
            send to it may need it to: Open MPI's shared-memory transport does once its
            per-peer buffer is full).
        native: use the C kernel for :meth:`sum_small` when it was built.
    """

    def __init__(self, node, MPI, capacity: int, progress: Callable[[], object], native: bool = True):
        self._progress = progress
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self.capacity = -(-int(capacity) // 64) * 64        # slots stay 64-byte aligned
        self._stride = _HEADER + DESC_BYTES + self.capacity
        self._win, bases = shared_window(node, MPI, 2 * self._stride)
        self._slots = [[np.frombuffer(base, dtype=np.uint8, count=self._stride, offset=s * self._stride)
                        for base in bases] for s in range(2)]
        # (memoryviews: an item reads or writes in about a third of a numpy scalar access's time)
        self._heads = [[memoryview(slot[:_HEADER].view(np.int64)) for slot in slots] for slots in self._slots]
        self._peer_heads = [[h for i, h in enumerate(heads) if i != self.rank] for heads in self._heads]
        self._posted = 0
        # Spinning helps when every rank has a core; oversubscribed, it takes the core from the rank
        # being waited for, so the wait then yields at once (benchmarks/allreduce.py at 4 ranks on
        # 2 cores shows the difference).
        self._spins = _SPINS if cores_per_rank_at_least_one(self.size) else 0
        self._descs: List[Optional[bytes]] = [None, None]    # the call last written into each own slot
        self._views: dict = {}                               # (slot, shape or size, dtype) -> payload views
        self._kernel = None
        if native and _mailbox_kernel is not None:
            slots = [slot for per_slot in self._slots for slot in per_slot]         # slot-major
            self._kernel = _mailbox_kernel.Kernel(
                self.rank, self.size, self.capacity, _SPIN_NS if self._spins else 0, _YIELD_NS,
                [slot.ctypes.data for slot in slots], [slot.ctypes.data + _HEADER + DESC_BYTES for slot in slots])

    def exchange(self, key_hash: int, desc: bytes, payload: Optional[np.ndarray], dtype,
                 note: Callable[[List[int]], None], announce: int = 0) -> bool:
        """Post this rank's call (and payload, cast to ``dtype``), wait for every rank's; return whether all match.

        The result is True when every rank posted ``key_hash``.

        ``payload`` has any shape; :meth:`payloads` with the same shape (or its
        size) reads it back.  Without one, ``announce`` is posted as this rank's
        payload bytes (:meth:`sizes`), and nothing is copied.  ``note(missing_ranks)`` is called when the wait
        runs past the first polls, and again whenever a rank arrives (the
        watchdog shows it).  After it returns, :meth:`payloads` and
        :meth:`calls` read this exchange until the next one.
        """
        self._posted = k = self._posted + 1
        s = k & 1
        head = self._heads[s][self.rank]
        if desc is not self._descs[s]:                      # a loop repeats its calls: skip the copy
            self._write_desc(s, desc)
        nbytes = announce
        if payload is not None:
            own = self._payload_views(s, payload.shape, dtype)[self.rank]
            own[...] = payload                              # (numpy assignment casts like casting="unsafe")
            nbytes = own.nbytes
        head[1] = key_hash
        head[2] = nbytes
        head[3] = len(desc)
        self._win.Sync()                                   # the call and payload before the flag
        head[0] = k
        for h in self._peer_heads[s]:
            if h[0] < k:
                self._wait(k, s, note)
                break
        self._win.Sync()                                   # the peers' calls after their flags
        for h in self._heads[s]:
            if h[1] != key_hash:
                return False
        return True

    def sum_code(self, dtype: np.dtype, op: str) -> Optional[int]:
        """Return the code :meth:`sum_small` takes for ``op`` over ``dtype``, or None where it cannot do it.

        The C kernel sums float32, float64, int32 and int64 (``avg`` is a sum
        divided afterwards); others, and a Mailbox without the kernel, use
        :meth:`exchange` and :func:`hpctrain.collectives.shm.shm_allreduce_small`.
        """
        return _KERNEL_SUMS.get(dtype) if self._kernel is not None and op in ("sum", "avg") else None

    def sum_small(self, key_hash: int, desc: bytes, x: np.ndarray, out: np.ndarray, code: int,
                  note: Callable[[List[int]], None]) -> bool:
        """:meth:`exchange` with ``x`` as the payload, then ``out = x_0 + x_1 + ...`` in rank order, in C.

        Returns whether every rank posted ``key_hash``; ``out`` is left alone
        when not.  ``x`` and ``out`` are C-contiguous arrays of the dtype of
        ``code`` (:meth:`sum_code`) and the same size.  The bits equal those of
        numpy's ``np.add`` chain in :func:`hpctrain.collectives.shm.shm_allreduce_small`.
        """
        self._posted = k = self._posted + 1
        s = k & 1
        if desc is not self._descs[s]:
            self._write_desc(s, desc)
        rc = self._kernel.allreduce(k, key_hash, len(desc), x, out, code)
        if rc == 2:                                         # a peer is late: wait as exchange() does
            self._wait(k, s, note)
            rc = self._kernel.reduce(k, key_hash, out, code)
        return rc == 0

    def post(self, key_hash: int, desc: bytes, raw: Optional[np.ndarray], note: Callable[[List[int]], None],
             announce: int = 0) -> bool:
        """:meth:`exchange` of the bytes ``raw`` (a C-contiguous array, posted as they are; or None, then
        ``announce`` is posted as the payload's bytes), in C where the kernel was built."""
        if self._kernel is None:
            return self.exchange(key_hash, desc, None if raw is None else raw.reshape(-1).view(np.uint8),
                                 np.uint8, note, announce)
        self._posted = k = self._posted + 1
        s = k & 1
        if desc is not self._descs[s]:
            self._write_desc(s, desc)
        rc = self._kernel.post(k, key_hash, len(desc), raw, announce)
        if rc == 2:                                         # a peer is late: wait as exchange() does
            self._wait(k, s, note)
            rc = self._kernel.check(k, key_hash)
        return rc == 0

    def gathered(self) -> Optional[np.ndarray]:
        """Return every rank's payload of the last exchange joined in rank order (a new writable uint8 array), or
        None when a rank's announced bytes did not fit its slot (so it posted none)."""
        if self._kernel is not None:
            joined = self._kernel.gather(self._posted)
            return None if joined is None else np.frombuffer(joined, dtype=np.uint8)
        sizes = self.sizes()
        return np.concatenate(self.raw_payloads(sizes)) if max(sizes) <= self.capacity else None

    def _write_desc(self, s: int, desc: bytes) -> None:
        self._slots[s][self.rank][_HEADER:_HEADER + len(desc)] = np.frombuffer(desc, dtype=np.uint8)
        self._descs[s] = desc

    def _wait(self, k: int, s: int, note) -> None:
        heads = self._heads[s]
        pending = self._peer_heads[s]
        polls, since, noted = 0, None, -1
        while pending:
            pending = [h for h in pending if h[0] < k]
            if not pending:
                return
            polls += 1
            if polls < self._spins:
                continue
            if since is None:
                since = time.monotonic()
            if len(pending) != noted:
                noted = len(pending)
                note([i for i, h in enumerate(heads) if h[0] < k])
            self._progress()
            if time.monotonic() - since < _SLEEP_AFTER_S:
                os.sched_yield()                            # (releases the GIL)
            else:
                time.sleep(1e-4)

    def calls(self) -> List[bytes]:
        """Return every rank's encoded call of the last exchange, in rank order."""
        s = self._posted & 1
        return [bytes(slot[_HEADER:_HEADER + int(h[3])]) for slot, h in zip(self._slots[s], self._heads[s])]

    def sizes(self) -> List[int]:
        """Return every rank's payload bytes of the last exchange (posted or announced), in rank order."""
        return [int(h[2]) for h in self._heads[self._posted & 1]]

    def raw_payloads(self, sizes: List[int]) -> List[np.ndarray]:
        """Return every rank's payload of the last exchange as flat bytes, ``sizes[i]`` of rank i's."""
        start = _HEADER + DESC_BYTES
        return [slot[start:start + n] for slot, n in zip(self._slots[self._posted & 1], sizes)]

    def payloads(self, shape, dtype: np.dtype) -> List[np.ndarray]:
        """Return every rank's payload of the last exchange as arrays of ``shape`` (or a size) and ``dtype``."""
        return self._payload_views(self._posted & 1, shape, dtype)

    def _payload_views(self, s: int, shape, dtype) -> List[np.ndarray]:
        key = (s, shape, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 64:
                self._views.clear()
            dtype = np.dtype(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if nbytes > self.capacity:
                raise ValueError(f"a payload of {nbytes} bytes does not fit a mailbox slot of {self.capacity}")
            views = self._views[key] = [slot[_HEADER + DESC_BYTES:_HEADER + DESC_BYTES + nbytes]
                                        .view(dtype).reshape(shape) for slot in self._slots[s]]
        return views

    def free(self) -> None:
        """Release the window (collective over the node)."""
        if self._win is not None:
            self._slots, self._heads, self._peer_heads, self._views, self._kernel = [], [], [], {}, None
            release_window(self._win)
            self._win = None
