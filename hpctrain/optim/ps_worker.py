"""A parameter-server worker's side of the protocol (:mod:`hpctrain.optim.parameter_server`): push, pull, finish."""
from __future__ import annotations

from typing import List

import numpy as np

from ..errors import RanksFailedError
from .ps_messages import TAG_DONE, TAG_FINAL, TAG_HELLO, TAG_PUSH, TAG_REPLY, Roles, pack, shard_bounds, unpack

__all__ = ["WorkerLink"]


class WorkerLink:
    """A worker's side: the first pull, then one push and pull per step, and the final pull.

    Args:
        comm: the communicator of workers and servers.
        roles: :class:`Roles` of ``comm``.
        n: the number of parameters; dtype: their dtype.
        compressor: compresses each pushed shard (error feedback as the compressor says), or None.
        on_server_lost: called with the failed server ranks when a reply cannot come (ends the job).
    """

    def __init__(self, comm, roles: Roles, n: int, dtype, compressor=None, on_server_lost=None):
        self.comm, self.roles, self.dtype = comm, roles, np.dtype(dtype)
        self.bounds = shard_bounds(n, len(roles.servers))
        self.compressor, self.on_server_lost = compressor, on_server_lost
        self.flat = np.empty(n, dtype=self.dtype)
        self.clock = 0
        self.bytes_pushed = 0
        self.global_steps = 0         # the gradients the servers had applied at the last reply (all workers')

    def hello(self) -> np.ndarray:
        """The servers' parameters and the clock to start at (``self.clock``)."""
        for s in self.roles.servers:
            self.comm.send_async(np.zeros(1, np.uint8), s, TAG_HELLO, header=False).wait()
        self.clock = self._pull(TAG_REPLY)
        return self.flat

    def push_pull(self, grad: np.ndarray) -> np.ndarray:
        """Push ``grad`` (flat, the parameters' layout) to the servers, then take the new parameters."""
        sends = []
        finite = bool(np.isfinite(grad).all())      # (not: an empty push, which every server skips)
        for s, (lo, hi) in zip(self.roles.servers, self.bounds):
            raw = pack(self.clock, self._payload(grad[lo:hi], s) if finite else [])
            self.bytes_pushed += raw.nbytes
            sends.append(self.comm.send_async(raw, s, TAG_PUSH, header=False, copy=False))
        self.clock = self._pull(TAG_REPLY)
        for h in sends:
            h.wait()
        return self.flat

    def finish(self) -> np.ndarray:
        """Say this worker is done; return the final parameters (once every live worker is done)."""
        for s in self.roles.servers:
            self.comm.send_async(np.zeros(1, np.uint8), s, TAG_DONE, header=False).wait()
        self._pull(TAG_FINAL, idle=True)      # (waiting for the slowest worker is this wait's job)
        return self.flat

    def _payload(self, g: np.ndarray, server: int) -> List[np.ndarray]:
        comp = self.compressor
        if comp is None:
            return [np.ascontiguousarray(g)]
        x = np.ascontiguousarray(g, dtype=np.float32)
        slot = comp.slot(f"shard{server}", x.shape, self.comm.rank)
        c = comp.compensate(x, slot)
        payload, ctx = comp.compress(c, slot)
        if ctx is not None:
            raise ValueError(f"compressor {comp.name!r} keeps what decompression needs on the sender; a parameter "
                             f"server cannot decompress it: use one whose payload says it all (fp16, bf16, topk, "
                             f"qsgd, terngrad, signsgd, onebit, ...)")
        comp.remember(c, comp.decompress(payload, None, x.size), slot)
        slot.step += 1
        return payload

    def _pull(self, tag: int, idle: bool = False) -> int:
        clock, applied = self.clock, None
        for s, (lo, hi) in zip(self.roles.servers, self.bounds):
            try:
                msg = self.comm.recv_any(s, tag, idle=idle)
            except RanksFailedError as exc:
                if self.on_server_lost is not None:
                    self.on_server_lost(exc.failed)
                raise
            clock, (theta, pushes) = unpack(msg.data)
            self.flat[lo:hi] = theta
            applied = int(pushes[0]) if applied is None else min(applied, int(pushes[0]))
        self.global_steps = applied
        return clock
