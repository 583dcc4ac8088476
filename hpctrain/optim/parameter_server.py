"""Parameter-server training on numpy buffers: servers hold shards of the parameters, workers push and pull.

Roles: the last ``servers`` ranks of the communicator serve, the others
train.  The flat parameter vector (``n`` values) is cut into ``servers``
contiguous shards whose sizes differ by at most one; server ``s`` holds shard
``s`` and its optimizer state.

Protocol, one message each way per server and worker step, point to point
(:meth:`~hpctrain.comm.base.Communicator.recv_any`, no collective while
training, so no global barrier):

* a worker at clock ``c`` pushes its gradient's shard to every server, then
  waits for each server's reply (that shard's parameters) and starts ``c + 1``;
* a server applies a push as it arrives: ``v <- m v + g / W + wd theta``,
  ``theta <- theta - lr v`` (``W``: the number of workers at the start), sets
  the worker's clock to ``c + 1`` and replies when
  ``clock[w] - min(clock of the live workers still training) <= S``; a worker
  more than ``S`` clocks ahead waits for the slowest (stale-synchronous
  parallel, Ho et al. 2013).  ``S = None``: no bound (fully asynchronous).

With ``S = 0`` every worker starts clock ``c + 1`` from the same parameters,
those after every worker's ``c``-th push: without momentum that is synchronous
SGD on the workers' averaged gradient (applied as ``W`` partial steps); with one
worker it is plain SGD whatever the momentum.

Each reply also says how many gradients the server has applied (all workers'
together): a run can stop at a global budget of steps, so that fast workers do
more of them than a straggler (``WorkerLink.global_steps``).

Cost per worker step: ``2 x servers`` messages carrying ``n`` values each way
(the push compressed when a compressor is given); a server does ``O(n / servers)``
work per push and sleeps while idle.  Failures (MPI's fault-tolerance
extension, ``hpctrain launch --elastic``): a worker that fails is dropped (the
others' waits stop counting it); a server that fails ends the job with a
message naming it, and the run resumes from the servers' newest checkpoint.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import numpy as np

from ..comm.ops.point_to_point import ANY
from ..errors import format_ranks
from ..errors import RanksFailedError
from .ps_messages import TAG_DONE, TAG_FINAL, TAG_HELLO, TAG_PUSH, TAG_REPLY, Roles, pack, shard_bounds, unpack
from .ps_worker import WorkerLink

__all__ = ["Roles", "ServerSGD", "ShardServer", "WorkerLink", "shard_bounds", "pack", "unpack"]

DIVERGED_AFTER = 3      # skipped pushes in a row from every training worker that end the job (see ShardServer._finite)


class ServerSGD:
    """SGD with momentum and weight decay, one push at a time: ``v <- m v + g * scale + wd theta``, ``theta -= lr v``.

    Cost: a few passes over the shard per push; state: one buffer (``v``) when ``momentum > 0``.
    """

    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)

    def apply(self, theta: np.ndarray, grad: np.ndarray, buf: np.ndarray, scale: float) -> None:
        """One update of ``theta`` (in place) by ``grad * scale``; ``buf`` is the momentum buffer."""
        g = grad.astype(theta.dtype, copy=False) * theta.dtype.type(scale)
        if self.weight_decay:
            g += self.weight_decay * theta
        if self.momentum:
            buf *= self.momentum
            buf += g
            g = buf
        theta -= self.lr * g


class ShardServer:
    """The loop of one server rank: take pushes, apply them, reply within the staleness bound.

    Args:
        comm: the communicator of workers and servers.
        roles: :class:`Roles` of ``comm``.
        theta: this server's shard of the initial parameters (updated in place).
        optimizer: a :class:`ServerSGD`.
        staleness: the bound ``S`` (None: none).
        compressor: the workers' push compressor (a :mod:`hpctrain.compression` one), or None.
        checkpoint: ``(manager, every)``: save this shard every ``every`` clocks of the slowest live worker
            (a :class:`~hpctrain.checkpoint.CheckpointManager` over the servers), or None.
        start: the clock the workers start at (a restored checkpoint's).
        on_server_lost: called with failed world ranks when a receive finds ranks failed (it ends the job when
            a server is among them).
        backup: synchronous rounds with this many backup workers instead of the staleness bound (see
            :meth:`_push_with_backup`); 0: none.
    """

    def __init__(self, comm, roles: Roles, theta: np.ndarray, optimizer: ServerSGD, staleness: Optional[int],
                 compressor=None, checkpoint=None, start: int = 0, on_server_lost=None, backup: int = 0):
        self.comm, self.roles, self.theta, self.opt = comm, roles, theta, optimizer
        self.buf = np.zeros_like(theta) if optimizer.momentum else theta[:0]
        self.staleness, self.compressor, self.checkpoint = staleness, compressor, checkpoint
        self.clock = {w: start for w in roles.workers}
        self.live, self.done = set(roles.workers), set()
        self.lost: set = set()        # workers known to have failed (from a receive or the watchdog)
        self.waiting: Dict[int, int] = {}     # worker -> clock its reply is held for
        self.saved_through = start    # the newest clock saved (or started from)
        self.pushes = 0
        self.backup, self.round, self.gathered, self.dropped = backup, start, {}, 0
        self.on_server_lost = on_server_lost
        self._sends: list = []
        self.skipped = 0              # gradients not applied because they held NaN or infinite values
        self.bad: Dict[int, int] = {}  # workers whose latest pushes were skipped: how many in a row
        self.said_bad: set = set()

    def restart_at(self, clock: int) -> None:
        """The workers start at ``clock`` (the restored checkpoint's)."""
        self.clock = {w: clock for w in self.roles.workers}
        self.saved_through = self.round = clock

    def drop(self, failed) -> None:
        """Stop counting the workers among ``failed`` (world ranks)."""
        mine = self.comm.world_ranks
        new = ({mine.index(r) for r in failed if r in mine} & set(self.roles.workers)) - self.lost
        if new:
            self.lost |= new
            rest = sorted(set(self.roles.workers) - self.lost)
            going = f"going on with worker {format_ranks(rest)}" if rest else "no worker is left"
            self._say(f"worker {format_ranks(sorted(new))} failed; {going}")

    def serve(self) -> np.ndarray:
        """Run until every live worker has finished; send each the final shard and return it."""
        while True:
            self._forget_lost()
            if not self.live - self.done:
                break
            try:
                msg = self.comm.recv_any(ANY, ANY, idle=True, timeout=0.25)
            except RanksFailedError as exc:
                if self.on_server_lost is not None:
                    self.on_server_lost(exc.failed)
                self.drop(exc.failed)
                continue
            if msg is None:
                self._check_left()
                continue
            w = msg.source
            if msg.tag == TAG_PUSH and self.backup:
                self._push_with_backup(w, *unpack(msg.data))
            elif msg.tag == TAG_PUSH:
                clock, payload = unpack(msg.data)
                grad = self._grad(payload) if payload else None
                if self._finite(w, clock, grad):
                    self._apply(grad, 1.0 / len(self.roles.workers))
                self.clock[w] = clock + 1
                self.waiting[w] = clock + 1
            elif msg.tag == TAG_HELLO:
                self._reply(w, self.clock[w], TAG_REPLY)
            elif msg.tag == TAG_DONE:
                self.done.add(w)
            if self.backup:
                self._close_round()
            self._release()
            self._save_due()
        for w in sorted(self.live):
            self._reply(w, self.clock[w], TAG_FINAL)
        self._settle(wait=True)
        return self.theta

    def _grad(self, payload: List[np.ndarray]) -> np.ndarray:
        n = self.theta.size
        grad = self.compressor.decompress(payload, None, n) if self.compressor is not None else payload[0]
        return grad.reshape(n)

    def _apply(self, grad: np.ndarray, scale: float, count: int = 1) -> None:
        self.opt.apply(self.theta, grad, self.buf, scale)
        self.pushes += count
        self._check_diverged()

    def _finite(self, w: int, clock: int, grad: Optional[np.ndarray]) -> bool:
        """Whether worker ``w``'s gradient of step ``clock`` may be applied.  The rule: a gradient with a NaN or an
        infinity is skipped (not applied; its worker goes on), said once per worker with its step, and counted
        (:attr:`skipped`); once every training worker's last :data:`DIVERGED_AFTER` pushes were all skipped the
        training has diverged and the job ends, naming the step.  The worker looks at its whole gradient and
        pushes no arrays for one that is not finite (``grad`` None), so every server skips it alike; a shard that
        a compressor made infinite (float16 overflow) is skipped by its server alone."""
        if grad is not None and np.isfinite(grad).all():
            self.bad.pop(w, None)
            return True
        self.skipped += 1
        self.bad[w] = self.bad.get(w, 0) + 1
        if w not in self.said_bad:
            self.said_bad.add(w)
            self._say(f"worker rank {w}'s gradient of step {clock} holds NaN or infinite values; skipped (not "
                      f"applied; later ones from it are skipped too while they are not finite)")
        if all(self.bad.get(v, 0) >= DIVERGED_AFTER for v in self.live - self.done):
            self.comm.abort(f"hpctrain: parameter server rank {self.comm.rank}: every training worker's last "
                            f"{DIVERGED_AFTER} gradients held NaN or infinite values (step {clock}): the training "
                            f"diverged; lower the servers' lr or momentum (stale gradients add momentum of their own) "
                            f"and start again")
        return False

    def _check_diverged(self) -> None:
        """End the job when the shard itself is no longer finite (an update of finite but huge gradients); looked at
        every 16 gradients (a pass over the shard)."""
        if self.pushes % 16 == 0 and not np.isfinite(self.theta).all():
            self.comm.abort(f"hpctrain: parameter server rank {self.comm.rank}: the parameters became NaN or "
                            f"infinite after {self.pushes} gradients (the training diverged); lower the servers' lr "
                            f"or momentum (stale gradients add momentum of their own) and start again")

    def _say(self, text: str) -> None:
        if self.comm.rank == self.roles.servers[0]:      # (one server says it)
            sys.stderr.write(f"hpctrain: parameter server rank {self.comm.rank}: {text}\n")
            sys.stderr.flush()

    def _push_with_backup(self, w: int, clock: int, payload: List[np.ndarray]) -> None:
        """Synchronous rounds with backup workers (Chen et al. 2016): a round's update is the mean of its first
        ``W - backup`` pushes (of those still training, if fewer); a push of a round already past is dropped and its
        worker brought to the current round."""
        grad = self._grad(payload) if payload else None
        if clock < self.round or not self._finite(w, clock, grad):   # (late, or not finite: dropped)
            self.dropped += 1
            self.clock[w] = self.round
            self._reply(w, self.round, TAG_REPLY)
            return
        self.gathered[w] = grad.copy()
        self.clock[w] = clock + 1

    def _close_round(self) -> None:
        """With backup workers: apply the round once enough pushes came (fewer are needed when workers finished
        or failed)."""
        need = min(len(self.roles.workers) - self.backup, len(self.live - self.done))
        if self.gathered and len(self.gathered) >= need:
            total = sum(self.gathered[v] for v in sorted(self.gathered))
            self._apply(total, 1.0 / len(self.gathered), len(self.gathered))
            self.round += 1
            for v in sorted(self.gathered):
                self.waiting[v] = self.round
            self.gathered = {}

    def _slowest(self) -> Optional[int]:
        training = [self.clock[w] for w in self.live - self.done]
        return min(training) if training else None

    def _release(self) -> None:
        """Reply to the held workers the bound now lets go (all of them once none is left training)."""
        slowest = self._slowest()
        for w, c in sorted(self.waiting.items()):
            if w not in self.live:
                del self.waiting[w]
            elif slowest is None or self.staleness is None or c - slowest <= self.staleness:
                del self.waiting[w]
                self._reply(w, c, TAG_REPLY)

    def _reply(self, w: int, clock: int, tag: int) -> None:
        raw = pack(clock, [self.theta, np.array([self.pushes], dtype=np.int64)])
        self._sends.append((w, self.comm.send_async(raw, w, tag, header=False, copy=False)))
        self._settle()

    def _settle(self, wait: bool = False) -> None:
        """Forget the replies that completed (or went to a worker that failed); all of them when ``wait``."""
        pending = []
        for w, h in self._sends:
            try:
                if wait and w not in self.lost:
                    h.wait()
                elif not h.test():
                    pending.append((w, h))
            except Exception:  # noqa: BLE001 - a send to a failed worker: it is dropped
                self.drop([self.comm.world_ranks[w]])
        self._sends = pending

    def _check_left(self) -> None:
        """End the job when a worker still counted has left it without finishing (it will never push again)."""
        left = self.comm.life.departed([self.comm.world_ranks[w] for w in self.live - self.done])
        if left:
            self.comm.abort(f"hpctrain: parameter server rank {self.comm.rank}: {left}, without finishing "
                            f"(ParameterServer.finish()) while this server serves it; ending the job")

    def _forget_lost(self) -> None:
        failed = self.comm.life.failure_policy.left_behind
        if failed:
            self.drop(failed)
        if self.lost & self.live:
            self.live -= self.lost
            if self.backup:
                self._close_round()
            self._release()

    def _save_due(self) -> None:
        if self.checkpoint is None:
            return
        manager, every = self.checkpoint
        clocks = [self.clock[w] for w in self.live]     # (the finished too: every server ends with the same)
        if not clocks:
            return
        slowest = min(clocks)
        while (self.saved_through // every + 1) * every <= slowest:   # each crossed multiple, on every server
            self.saved_through = (self.saved_through // every + 1) * every
            manager.save(self.saved_through, self.checkpoint_state())

    def checkpoint_state(self) -> Dict[str, Any]:
        """The state a checkpoint holds: this shard and the gradients it applied (Sharded by shard id), the clock."""
        from ..checkpoint import Sharded

        return {"theta": Sharded(self.theta), "momentum": Sharded(self.buf), "clock": self.saved_through,
                "pushes": Sharded(np.array([self.pushes], np.int64), missing="skip")}

    def restored(self, state: Dict[str, Any]) -> None:
        """Go on from a restored :meth:`checkpoint_state`: the workers start at its clock and the count of applied
        gradients goes on from its (a budget of ``global_steps`` is the job's, not the restart's)."""
        self.restart_at(int(state["clock"]))
        self.pushes = int(np.asarray(state["pushes"].obj)[0])
