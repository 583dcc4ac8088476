"""Asynchronous parameter-server training of a torch model (hpctrain.optim.parameter_server converts to and from).

Every rank runs the same script::

    ps = ht.ParameterServer(model, lr=0.1, servers=1, staleness=1, checkpoint_dir="ckpt")
    if ps.is_server:
        ps.serve()                        # until every worker has finished
    else:
        for step in range(ps.start_step, steps):
            loss_fn(model(x[step]), y[step]).backward()   # (gradients from zero: the step clears them)
            ps.step()                     # push the gradients, pull the parameters
        ps.finish()                       # the final parameters, the same on every worker

Launch with ``hpctrain launch --elastic`` for a worker's loss not to end the job.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import format_ranks
from ..optim.parameter_server import Roles, ServerSGD, ShardServer, WorkerLink, shard_bounds
from .flat import flatten, unflatten_into

__all__ = ["ParameterServer"]


class ParameterServer:
    """Train ``model`` with parameter servers: the last ``servers`` ranks hold the parameters, the others train.

    The servers apply each worker's gradient as it arrives (SGD with
    ``momentum`` and ``weight_decay``, each push scaled by 1 / workers); a
    worker more than ``staleness`` steps ahead of the slowest one waits
    (``None``: never); see :mod:`hpctrain.optim.parameter_server` for the
    protocol and its cost.  With ``staleness=0`` and no momentum it is
    synchronous SGD on the workers' averaged gradient; with one worker, plain SGD.

    Args:
        model: the torch model (the same architecture on every rank; the servers' initial values win).
        lr, momentum, weight_decay: the servers' SGD.  Stale gradients act as momentum of their own (about
            ``1 - 1 / workers`` without a bound, Mitliagkas et al. 2016): start without momentum (lr 0.3,
            momentum 0 converged on the README's regressions where 0.3 / 0.7 and 0.1 / 0.9 diverged) and add it
            only where a run shows it helps.  A gradient with a NaN or an infinity is skipped and named; the job
            ends once every worker's last 3 were (:meth:`hpctrain.optim.parameter_server.ShardServer._finite`).
        servers: how many ranks serve (the last ones).
        staleness: the bound ``S`` (an int >= 0, or None).
        compression: a compressor (or its name) for the pushed gradients, or None.
        checkpoint_dir: where the servers checkpoint their shards (with the existing manager), every
            ``checkpoint_every`` steps of the slowest worker; a run started again resumes there.
        backup_workers: instead of the staleness bound, synchronous steps that each take the first
            ``workers - backup_workers`` gradients to arrive and drop the rest (Chen et al. 2016: the
            stragglers' gradients are dropped, not waited for).
        comm: the communicator (default: the world).

    Collective at construction (every rank); then only point-to-point messages.
    """

    def __init__(self, model: torch.nn.Module, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                 servers: int = 1, staleness: Optional[int] = 0, compression=None,
                 checkpoint_dir: Optional[str] = None, checkpoint_every: int = 100, backup_workers: int = 0,
                 comm=None):
        if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
            raise ValueError(f"staleness must be an int >= 0 or None, got {staleness!r}")
        if not isinstance(backup_workers, int) or backup_workers < 0:
            raise ValueError(f"backup_workers must be an int >= 0, got {backup_workers!r}")
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be an int >= 1, got {checkpoint_every!r}")
        if comm is None:
            from .. import world
            comm = world()
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) != 1:
            raise ValueError(f"a parameter server holds one flat vector of one dtype; the model's parameters "
                             f"have {', '.join(dtypes) or 'none'}")
        from ..compression import gradient_compressor
        compressor = gradient_compressor("avg", compression)
        if compressor is not None and compressor.communication == "custom":
            raise ValueError(f"compressor {compressor.name!r} runs collectives of its own; a parameter server "
                             f"takes one whose payload says it all (fp16, bf16, topk, qsgd, signsgd, ...)")
        self.comm, self.roles, self.checkpoint_dir = comm, Roles(comm.size, servers), checkpoint_dir
        if backup_workers >= len(self.roles.workers):
            raise ValueError(f"backup_workers ({backup_workers}) must be fewer than the workers "
                             f"({len(self.roles.workers)}): a step needs one gradient")
        self.is_server = comm.rank in self.roles.servers
        self.worker_rank = None if self.is_server else self.roles.workers.index(comm.rank)
        self.num_workers = len(self.roles.workers)
        flat = flatten(self.params).numpy()
        self._servers = comm.split(0 if self.is_server else None)     # (collective: every rank)
        comm.on_rank_failure(self._on_failure)      # (for the process's life: the failed are not waited for at exit)
        self.start_step = 0
        if self.is_server:
            lo, hi = shard_bounds(flat.size, servers)[self.roles.shard_of(comm.rank)]
            ckpt = None
            if checkpoint_dir is not None:
                from ..checkpoint import CheckpointManager
                ckpt = (CheckpointManager(checkpoint_dir, comm=self._servers), checkpoint_every)
            self.server = ShardServer(comm, self.roles, flat[lo:hi].copy(), ServerSGD(lr, momentum, weight_decay),
                                      None if backup_workers else staleness, compressor, ckpt,
                                      on_server_lost=self._server_lost, backup=backup_workers)
            if ckpt is not None:
                state = self.server.checkpoint_state()
                if ckpt[0].restore(state) is not None:
                    self.server.restored(state)
        else:
            self.link = WorkerLink(comm, self.roles, flat.size, flat.dtype, compressor, self._server_lost)
            unflatten_into(self.link.hello(), self.params)
            self.start_step = self.link.clock

    def serve(self) -> None:
        """(servers) Serve until every live worker has finished; the final shard's checkpoint is saved."""
        self._only(True, "serve")
        self.server.serve()
        if self.server.checkpoint is not None:
            self.server.checkpoint[0].wait()

    def step(self) -> None:
        """(workers) Push this worker's gradients, take the new parameters into the model, clear the gradients."""
        self._only(False, "step")
        grads = flatten(p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params).numpy()
        unflatten_into(self.link.push_pull(grads), self.params)
        for p in self.params:
            p.grad = None

    def finish(self) -> None:
        """(workers) Say this worker is done; the final parameters (those after every worker's last push) come
        into the model once every live worker is done."""
        self._only(False, "finish")
        unflatten_into(self.link.finish(), self.params)

    @property
    def global_steps(self) -> int:
        """(workers) The gradients the servers had applied, all workers' together, at this worker's last pull
        (counted on from the checkpoint after a restart): a budget for a run where fast workers do more steps than
        slow ones."""
        return self.link.global_steps

    @property
    def bytes_pushed(self) -> int:
        """Bytes this worker has pushed so far."""
        return 0 if self.is_server else self.link.bytes_pushed

    def _only(self, server: bool, what: str) -> None:
        if self.is_server != server:
            raise RuntimeError(f"ParameterServer.{what}() is for {'server' if server else 'worker'} ranks; rank "
                               f"{self.comm.rank} is a {'server' if self.is_server else 'worker'} "
                               f"(servers: {format_ranks(self.roles.servers)})")

    def _on_failure(self, failed) -> None:
        """The watchdog's news (world ranks): a lost server ends the job; lost workers the servers drop."""
        self._server_lost(failed)

    def _server_lost(self, failed) -> None:
        ranks = [self.comm.world_ranks.index(r) for r in failed if r in self.comm.world_ranks]
        lost = [r for r in ranks if r in self.roles.servers]
        if not lost:
            return
        shards = [self.roles.shard_of(r) for r in lost]
        then = (f"run it again to resume from the servers' newest checkpoint in {self.checkpoint_dir}"
                if self.checkpoint_dir else "no checkpoint_dir was given, so a new run starts over")
        # (not MPI_Abort: after a failure under ULFM it can leave Open MPI's launcher deadlocked once every rank has
        # gone; this rank's own exit ends it, and every other survivor learns of the same server and exits too)
        self.comm.life.exit_after_failure(f"hpctrain: rank {self.comm.rank}: parameter server {format_ranks(lost)} "
                                         f"(shard {', '.join(map(str, shards))} of {len(self.roles.servers)}) failed "
                                         f"(the process died or its node was lost); the parameters it held are gone, "
                                         f"ending the job: {then}")
