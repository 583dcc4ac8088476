"""Pipeline parallelism for PyTorch: an ``nn.Sequential`` split into stages, run by a schedule.

Each rank of a :class:`~hpctrain.parallel.ParallelLayout` pipeline group holds
one stage.  ``train_step(inputs, targets)`` splits the batch into ``m``
micro-batches (``torch.tensor_split``: sizes differ by at most one) and runs
the schedule's actions (:mod:`hpctrain.parallel.schedule`): activations go to
the next stage and their gradients come back by point-to-point messages on the
pipeline communicator (:mod:`hpctrain.parallel.links`: shapes travel with the
first message of each link only); sends are asynchronous.  Micro-batch ``i`` of ``b_i``
samples contributes ``(b_i / B) loss_i`` (``loss_fn`` a mean), so the
gradients equal those of the whole batch of ``B`` on one process.  The loss
comes back on every rank of the pipeline.

With an hpctrain optimizer on the data-parallel group (DistributedOptimizer,
ShardedOptimizer, LocalSGDOptimizer; pass it to ``train_step``), the
micro-batch backward passes but the last run inside its ``no_sync()``, so the
data-parallel reduction happens once per step, after the last micro-batch;
the optimizer's division by the number of passes is undone in the loss scale
(``op="adasum"`` sums the passes, as Horovod's: nothing to undo).

An exception in a stage (a shape that does not fit the next stage, say) is
sent along the pipeline in place of every message the stage still owed, so
every rank raises :class:`PipelineError` naming the stage that failed, instead
of waiting forever.  The pipeline cannot be used after that.

Memory: GPipe keeps the activations of all ``m`` micro-batches; 1F1B at most
``p - s`` on stage ``s`` (``p + 1`` on the first of several: see :mod:`hpctrain.parallel.schedule`).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from ..parallel.links import PipelineError, StageLinks
from ..tensors import to_numpy
from ..parallel.schedule import schedule as make_schedule

__all__ = ["Pipeline", "PipelineError", "balance_by_parameters"]


def balance_by_parameters(layers: Sequence[torch.nn.Module], stages: int) -> List[int]:
    """Layer counts per stage splitting ``layers`` (in order) so the largest stage's parameter count is smallest.

    Exact by dynamic programming over contiguous splits (O(n^2 p)); every
    stage gets at least one layer.
    """
    n = len(layers)
    if n < stages:
        raise ValueError(f"cannot split {n} layers into {stages} pipeline stages")
    weight = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    prefix = np.concatenate([[0], np.cumsum(weight)])
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    counts, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


class Pipeline(torch.nn.Module):
    """One stage of a pipeline-parallel ``nn.Sequential`` on this rank.

    Args:
        module_or_stages: an ``nn.Sequential`` (split here) or a list of
            ``p`` modules, one per stage.
        layout: the :class:`~hpctrain.parallel.ParallelLayout`; its pipeline
            group runs the stages in order of its ``pp`` coordinate.
        micro_batches: ``m``, the micro-batches per step.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        balance: layer counts per stage (default: balanced by parameter count).
        loss_fn: ``loss_fn(output, target)``, a mean over the samples.
    """

    def __init__(self, module_or_stages, layout, micro_batches: int, schedule: str = "1f1b",
                 balance: Optional[Sequence[int]] = None, loss_fn: Optional[Callable] = None):
        super().__init__()
        p, s = layout.num_stages, layout.stage
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        make_schedule(schedule, p, micro_batches, s)               # validates the name
        if isinstance(module_or_stages, torch.nn.Sequential):
            layers = list(module_or_stages)
            counts = list(balance) if balance is not None else balance_by_parameters(layers, p)
            if len(counts) != p or sum(counts) != len(layers) or min(counts) < 1:
                raise ValueError(f"balance {counts} must give each of the {p} stages at least one of the "
                                 f"{len(layers)} layers")
            start = sum(counts[:s])
            self.stage_module = torch.nn.Sequential(*layers[start:start + counts[s]])
        else:
            stages = list(module_or_stages)
            if len(stages) != p:
                raise ValueError(f"got {len(stages)} stage modules for a pipeline of {p} stages")
            self.stage_module = stages[s]
        self.layout, self.comm = layout, layout.pp_comm
        self.stage, self.stages, self.micro_batches = s, p, micro_batches
        self.schedule_name = schedule
        self.actions = make_schedule(schedule, p, micro_batches, s)
        self.loss_fn = loss_fn if loss_fn is not None else torch.nn.functional.cross_entropy
        self.peak_in_flight = 0       # the most micro-batches whose activations were held at once
        self.links = StageLinks(self.comm, s)
        self._device: Optional[torch.device] = None      # this stage's device if not the CPU (set each step)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def forward(self, x):
        """This stage's module alone (no communication)."""
        return self.stage_module(x)

    # -- messages -------------------------------------------------------------------
    def _recv(self, kind: str, micro: int) -> torch.Tensor:
        """Receive micro-batch ``micro``'s activation ("F") or its gradient ("B"), on this stage's device.

        Messages travel through host memory (a CUDA stage pays one copy each way).
        """
        source = self.stage - 1 if kind == "F" else self.stage + 1
        t = torch.from_numpy(self.links.recv(source, 2 * micro + (kind == "B"), kind))
        return t if self._device is None else t.to(self._device)

    def _send(self, t: torch.Tensor, kind: str, micro: int):
        """Start sending ``t`` without a copy: nothing writes to an activation or its gradient once computed,
        and the handle keeps the memory alive until the message is out (a CUDA tensor is copied to the host)."""
        dest = self.stage + 1 if kind == "F" else self.stage - 1
        return self.links.send_async(to_numpy(t.detach())[0], dest, 2 * micro + (kind == "B"), kind, copy=False)

    @torch.no_grad()
    def infer(self, inputs: Optional[torch.Tensor]) -> torch.Tensor:
        """The whole model's output for ``inputs`` (needed on the first stage), on every rank of the pipeline,
        on each rank's own device (that of its stage's parameters)."""
        device = next((p.device for p in self.stage_module.parameters()), torch.device("cpu"))
        x = inputs if self.first else torch.from_numpy(self.comm.recv(self.stage - 1, tag=0)).to(device)
        out = self.stage_module(x)
        if not self.last:
            self.comm.send(out, self.stage + 1, tag=0)
            out = None
        meta = self.comm.broadcast_object(None if out is None else (tuple(out.shape), str(out.dtype)[6:]),
                                          root=self.stages - 1)
        buf = out.contiguous() if out is not None else torch.zeros(meta[0], dtype=getattr(torch, meta[1]),
                                                                   device=device)
        return self.comm.broadcast(buf, root=self.stages - 1)

    # -- one training step ------------------------------------------------------------
    def train_step(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor], optimizer=None
                   ) -> torch.Tensor:
        """Run forward and backward of one batch through the pipeline; return the batch's loss on every rank.

        ``inputs`` is needed on the first stage and ``targets`` on the last
        (other ranks may pass None).  Gradients accumulate in this stage's
        parameters; call ``optimizer.step()`` afterwards.
        """
        m = self.micro_batches
        device = next((p.device for p in self.stage_module.parameters()), None)
        self._device = device if device is not None and device.type != "cpu" else None   # where messages go
        xs = list(torch.tensor_split(inputs, m)) if self.first else None
        ys = list(torch.tensor_split(targets, m)) if self.last else None
        if self.last:
            sizes = [len(y) for y in ys]
            if min(sizes) == 0:
                raise ValueError(f"a batch of {sum(sizes)} samples cannot make {m} micro-batches")
        # an hpctrain optimizer says what it does with accumulated passes: "averaged" is undone in the loss scale
        passes = getattr(optimizer, "hpctrain_passes", None)
        dist = passes is not None
        held, outs, losses, sends = {}, {}, [], []
        last_b = max(i for i, a in enumerate(self.actions) if a.kind == "B")
        for k, action in enumerate(self.actions):
            i = action.micro
            try:
                if action.kind == "F":
                    if self.first:
                        x = xs[i]
                    else:
                        x = self._recv("F", i).requires_grad_(True)
                    out = self.stage_module(x)
                    held[i] = x
                    self.peak_in_flight = max(self.peak_in_flight, len(held))
                    if self.last:
                        scale = len(ys[i]) / sum(sizes) * (m if passes == "averaged" else 1)
                        outs[i] = self.loss_fn(out, ys[i]) * scale
                        losses.append(outs[i].detach())
                    else:
                        outs[i] = out
                        sends.append(self._send(out, "F", i))
                else:
                    grad = None if self.last else self._recv("B", i)
                    ctx = optimizer.no_sync() if dist and k != last_b else contextlib.nullcontext()
                    out = outs.pop(i)
                    if out.requires_grad:             # (a first stage without parameters has nothing to do)
                        with ctx:
                            torch.autograd.backward(out, grad)
                    x = held.pop(i)
                    if not self.first:
                        g = x.grad if x.grad is not None else torch.zeros_like(x)
                        sends.append(self._send(g, "B", i))
            except Exception as exc:
                text = (f"stage {self.stage} (rank {self.layout.comm.rank}) failed in {action.kind} of "
                        f"micro-batch {i}: {type(exc).__name__}: {exc}")
                if isinstance(exc, PipelineError):
                    text = str(exc)
                # this action's message and every later one are owed; earlier sends may never be
                # received now, so they are not waited for (the pipeline cannot go on after this)
                self.links.fail_remaining(self.actions[k:], self.stages, text)
                raise PipelineError(text) from exc
        for h in sends:
            h.wait()
        # (sent as float64, whatever the loss's dtype: every stage knows the message; each returns its parameters')
        dtype = next((p.dtype for p in self.stage_module.parameters() if p.is_floating_point()), torch.float32)
        total = torch.stack(losses).sum() / (m if passes == "averaged" else 1) if self.last else torch.zeros(())
        return self.comm.broadcast(total.to(torch.float64).reshape(1), root=self.stages - 1).reshape(()).to(dtype)
