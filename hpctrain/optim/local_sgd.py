"""Local SGD and DiLoCo on numpy buffers: ranks step on their own gradients and meet every H steps.

Rule (N ranks, step t counted from 1, flat parameters ``theta_r`` of rank r, a
global copy ``theta_g`` that every rank keeps alike):

* warm-up, ``t <= W``: gradients are averaged every step (synchronous
  training); ``theta_g`` is taken at its end (at the start when ``W = 0``);
* after it each rank steps alone, and at every ``t`` with ``(t - W) % H == 0``
  the outer step runs on the averaged delta (one all-reduce of the flat
  parameters, through a compressor when one is given)::

      delta = (1/N) sum_r (theta_g - theta_r)
      no outer optimizer:  theta_g <- theta_g - delta          (the ranks' mean)
      SGD, Nesterov:       m <- mu m + delta
                           theta_g <- theta_g - lr (delta + mu m)   (DiLoCo: lr 0.7, mu 0.9)
      every rank:          theta_r <- theta_g

With ``H = 1`` and no outer optimizer, SGD with momentum (a linear update)
equals synchronous training: the mean of the ranks' buffers is the buffer of
the averaged gradients.

Rounds of a time instead of H steps (``sync_every_s = T``): each rank syncs at
the first step that ends ``T`` seconds or more after the last sync (its own
clock), so a fast rank does more local steps in a round than a straggler
instead of waiting for it; every rank still syncs once a round, so the
all-reduces line up.  The ranks' step counts then differ: each sync also sums
them (one more 8-byte all-reduce), and :attr:`LocalSGD.global_steps`, the same
on every rank, is what a training loop must stop on (a loop of a fixed number
of steps would leave the ranks at different numbers of syncs).

State (what a restart needs, :meth:`LocalSGD.common_state` and
:meth:`LocalSGD.own_state`): alike on every rank the global copy, the outer
momentum and the sync counters; per rank its own parameters, its inner
optimizer's state and its step counts.  Restored at the same world size each
rank takes its own part back (the run goes on as if never stopped).  At another
world size the interrupted round is finished first from every saved rank's
parameters (:meth:`LocalSGD.finish_round`: the outer step on their mean delta,
exactly what the sync would have done at the old size), every new rank starts
from that global copy, and new rank ``r`` takes saved rank ``r mod N``'s inner
optimizer state (nothing is averaged that the rule does not average).

Cost: one all-reduce of P parameter values every H steps instead of one of
the P gradient values every step, so the bytes on the wire fall H-fold
(``2 (N-1)/N P`` values per sync for a ring); one more copy of the
parameters (``theta_g``) and, with the outer optimizer, one of its momentum.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import time

import numpy as np

from ..checkpoint.spread import LOCAL_SGD_FORMAT

__all__ = ["LocalSGD", "OuterNesterov", "START", "SYNC", "LOCAL_SGD_FORMAT"]

START, SYNC = 1, 2      # what step_done() asks of the adapter


class OuterNesterov:
    """The outer optimizer of DiLoCo: SGD with Nesterov momentum on the averaged delta (module docstring)."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9):
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"OuterNesterov needs lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr, self.momentum = float(lr), float(momentum)
        self.buf: Optional[np.ndarray] = None

    def step(self, theta_g: np.ndarray, delta: np.ndarray) -> None:
        """``theta_g`` updated in place by one Nesterov step on ``delta``."""
        if self.buf is None:
            self.buf = np.zeros_like(delta)
        self.buf *= self.momentum
        self.buf += delta
        theta_g -= self.lr * (delta + self.momentum * self.buf)


class LocalSGD:
    """The schedule and the outer step of local SGD / DiLoCo over ``comm`` (module docstring for the rule).

    Adapters call :meth:`start` with the flat parameters once they are alike
    on every rank, :attr:`synchronous` to know whether this step's gradients
    are averaged, and :meth:`step_done` after each optimizer step, which says
    whether to hand the flat parameters to :meth:`after_step` (a collective
    when it syncs).

    Args:
        comm: the communicator (default: the world).
        sync_every: H, local steps between outer steps (1 or more).
        warmup_steps: W, synchronous steps first (gradients averaged).
        outer: None (the ranks' mean), or an :class:`OuterNesterov`.
        compression: a compressor of :mod:`hpctrain.compression` (or its name) for the delta.
        sync_every_s: rounds of this many seconds instead of ``sync_every`` steps (module docstring).
    """

    def __init__(self, comm=None, sync_every: int = 16, warmup_steps: int = 0,
                 outer: Optional[OuterNesterov] = None, compression: Any = None,
                 sync_every_s: Optional[float] = None):
        from .. import settings
        from ..world import comm_or_world

        settings.refuse_under_elastic(
            "local SGD / DiLoCo", "each rank's parameters between syncs and the global copy are not part of "
            "a commit", "launch without --elastic and resume from its checkpoints (they restore at any world "
            "size), or train elastically with DistributedOptimizer")
        if int(sync_every) < 1 or int(warmup_steps) < 0:
            raise ValueError(f"local SGD needs sync_every >= 1 and warmup_steps >= 0, got {sync_every} and "
                             f"{warmup_steps}")
        if sync_every_s is not None and not sync_every_s > 0:
            raise ValueError(f"sync_every_s must be a positive number of seconds or None, got {sync_every_s!r}")
        self.sync_every_s = None if sync_every_s is None else float(sync_every_s)
        self._round_start = time.monotonic()
        self.comm = comm_or_world(comm)
        self.sync_every, self.warmup_steps, self.outer = int(sync_every), int(warmup_steps), outer
        self.reducer = None
        if compression is not None:
            from ..compression import Policy, gradient_compressor, reducer_for

            compressor = gradient_compressor("avg", compression)
            self.reducer = reducer_for(compressor, self.comm, Policy(min_numel=0, skip=()))
        self.steps = 0              # optimizer steps done
        self.syncs = 0              # outer steps done
        self.global_steps = 0       # every rank's steps, summed at the last sync (the same on every rank)
        self.synced_at = 0          # this rank's steps at its last sync (or at the end of the warm-up)
        self.global_offset = 0      # steps a resized restore carried over that no live rank counts (rounds of a time)
        self.theta_g: Optional[np.ndarray] = None

    @property
    def synchronous(self) -> bool:
        """Whether the step under way averages its gradients (the warm-up)."""
        return self.steps < self.warmup_steps

    def start(self, flat: np.ndarray) -> None:
        """Take the global copy from ``flat``, the parameters (alike on every rank)."""
        self.theta_g = np.array(flat, copy=True)
        self.synced_at = self.steps
        self._round_start = time.monotonic()

    def step_done(self) -> int:
        """Count one optimizer step; what the parameters must now go through: 0, or the bits :data:`START` (the
        warm-up just ended: take the global copy) and :data:`SYNC` (the outer step), for :meth:`after_step`."""
        self.steps += 1
        past = self.steps - self.warmup_steps
        if self.sync_every_s is not None:
            due = past > 0 and time.monotonic() - self._round_start >= self.sync_every_s
        else:
            due = past > 0 and past % self.sync_every == 0
        return (START if self.warmup_steps > 0 and past == 0 else 0) | (SYNC if due else 0)

    def after_step(self, todo: int, flat: np.ndarray) -> None:
        """Do :meth:`step_done`'s ``todo`` with ``flat``, this rank's parameters (changed in place by a sync)."""
        if todo & START:
            self.start(flat)
        if todo & SYNC:
            self.sync(flat)

    def sync(self, flat: np.ndarray) -> None:
        """The outer step (collective): ``flat``, this rank's parameters, becomes the new global copy, in place."""
        if self.theta_g is None or self.theta_g.shape != flat.shape:
            raise RuntimeError("LocalSGD.sync() before start() with parameters of this size")
        delta = self.theta_g - flat
        if self.reducer is not None:
            (delta,) = self.reducer.reduce([("delta", delta)], op="avg")
        elif self.comm.size > 1:
            delta = np.asarray(self.comm.allreduce(delta, op="avg"))
        self._outer_step(delta)
        flat[...] = self.theta_g
        self.synced_at = self.steps
        if self.sync_every_s is not None:
            if self.comm.size > 1:
                self.global_steps = int(np.asarray(self.comm.allreduce(np.array([self.steps], np.int64)))[0])
            else:
                self.global_steps = self.steps
            self.global_steps += self.global_offset
            self._round_start = time.monotonic()
        else:
            self.global_steps = self.steps * self.comm.size

    def _outer_step(self, delta: np.ndarray) -> None:
        """``theta_g`` moved by the averaged ``delta`` (the ranks' mean, or the outer optimizer's step)."""
        if self.outer is None:
            self.theta_g -= delta
        else:
            self.outer.step(self.theta_g, delta)
        self.syncs += 1

    def finish_round(self, params: List[np.ndarray]) -> None:
        """The outer step of an interrupted round, in one process, from every rank's ``params`` (a restore at
        another world size: :meth:`load_saved`).  Cost: one pass over N parameter copies."""
        delta = np.zeros_like(self.theta_g)
        for p in params:
            delta += self.theta_g - np.asarray(p, dtype=self.theta_g.dtype)
        delta /= len(params)
        self._outer_step(delta)

    def common_state(self) -> Dict[str, Any]:
        """What every rank holds alike: the global copy, the outer momentum, the sync counters."""
        out: Dict[str, Any] = {"syncs": self.syncs, "global_steps": self.global_steps,
                               "global_offset": self.global_offset}
        if self.theta_g is not None:
            out["theta_g"] = self.theta_g.copy()
        if self.outer is not None and self.outer.buf is not None:
            out["outer_momentum"] = self.outer.buf.copy()
        return out

    def own_state(self) -> Dict[str, int]:
        """What is this rank's own: its step counts (they differ between ranks in rounds of a time)."""
        return {"steps": self.steps, "synced_at": self.synced_at}

    def state_dict(self) -> Dict[str, Any]:
        """:meth:`common_state` and :meth:`own_state` of this rank in one dict."""
        return {**self.common_state(), **self.own_state()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take back a :meth:`state_dict` (this rank's own part, or one rank's at the same world size)."""
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        self.synced_at = int(state.get("synced_at", self.steps))
        self.global_steps = int(state.get("global_steps", self.steps * self.comm.size))
        self.global_offset = int(state.get("global_offset", 0))
        self.theta_g = np.array(state["theta_g"], copy=True) if "theta_g" in state else None
        if self.outer is not None:
            self.outer.buf = np.array(state["outer_momentum"], copy=True) if "outer_momentum" in state else None
        self._round_start = time.monotonic()

    def load_saved(self, common: Dict[str, Any], read) -> Tuple[np.ndarray, Dict[str, Any]]:
        """Go on at this world size from a saved state spread over N ranks; return this rank's parameters and the
        saved part whose inner optimizer state it takes.

        ``common`` is the adapter's common part (``"world"``: N, ``"core"``:
        :meth:`common_state`), ``read(rank)`` a saved rank's own part
        (``"core"``: :meth:`own_state`, ``"params"``: its flat parameters).
        Same size: this rank's own part, as saved.  Another size: the round the
        saved ranks were in is finished (:meth:`finish_round`) and every rank
        starts from the new global copy; new rank ``r`` takes saved rank
        ``r mod N``'s part (rounds of a time: its step count too, and
        :attr:`global_steps` keeps counting every saved step).
        """
        n, rank, size = int(common["world"]), self.comm.rank, self.comm.size
        if n == size:
            own = read(rank)
            self.load_state_dict({**common["core"], **own["core"]})
            return np.array(own["params"], copy=True), own
        owns = [read(r) for r in range(n)]
        cores = [o["core"] for o in owns]
        self.load_state_dict({**common["core"], **cores[rank % n]})
        mine = np.array(owns[0]["params"], copy=True)       # (no round under way: every saved rank's alike)
        if self.theta_g is not None and any(int(c["steps"]) > max(int(c["synced_at"]), self.warmup_steps)
                                            for c in cores):
            self.finish_round([np.asarray(o["params"]) for o in owns])
            mine = self.theta_g.copy()
            if self.sync_every_s is not None:
                self.global_steps = sum(int(c["steps"]) for c in cores) + int(common["core"].get("global_offset", 0))
            else:
                self.global_steps = self.steps * n
            self.synced_at = self.steps
        if self.sync_every_s is not None:
            # (the steps no new rank counts: what the saved ranks did beyond what their heirs take over)
            self.global_offset = self.global_steps - sum(int(cores[r % n]["steps"]) for r in range(size))
        return mine, owns[rank % n]
