"""Tensor-parallel (Megatron-style) layers: a linear layer's weight split over the ranks of a tp group.

With ``t`` ranks in the tensor-parallel communicator (``layout.tp_comm``):

* :class:`ColumnParallelLinear` holds rows ``[i out/t, (i+1) out/t)`` of the
  weight (output features): ``y_i = x W_i^T + b_i``.  Its input is the same
  on every rank; in backward the input gradients of the ranks are summed
  (one all-reduce of ``x``'s size).  ``gather_output=True`` all-gathers
  ``y`` along the last dim.
* :class:`RowParallelLinear` holds columns ``[i in/t, (i+1) in/t)`` (input
  features): ``y = sum_i x_i W_i^T + b``, one all-reduce of ``y``'s size in
  forward; its input is already split (the output of a column-parallel
  layer), or is split here when ``input_is_parallel=False``.

A column-parallel layer followed by a row-parallel one (:class:`ParallelMLP`,
and the heads of :class:`ParallelSelfAttention`) needs one all-reduce in
forward and one in backward for the pair, and each rank holds ``1/t`` of
the weights.  The collectives are autograd functions over hpctrain's
communicator; the results are identical on the ranks of the group.
``from_linear`` shards an existing ``nn.Linear`` (every rank passes the same
one), so a sharded model starts exactly where a single-process model does.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention"]


def _allreduce(t: torch.Tensor, comm) -> torch.Tensor:
    return comm.allreduce(t.contiguous(), op="sum") if comm.size > 1 else t


def _gather_last(t: torch.Tensor, comm) -> torch.Tensor:
    if comm.size == 1:
        return t
    moved = t.movedim(-1, 0).contiguous()
    return comm.allgather(moved).movedim(0, -1).contiguous()


def _own_slice(t: torch.Tensor, comm) -> torch.Tensor:
    width = t.shape[-1] // comm.size
    return t[..., comm.rank * width:(comm.rank + 1) * width].contiguous()


class _CopyToTP(torch.autograd.Function):
    """Forward: identity; backward: sum the gradient over the group (the input was used by every shard)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _allreduce(g, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward: sum the partial outputs over the group; backward: identity."""

    @staticmethod
    def forward(ctx, x, comm):
        return _allreduce(x, comm)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: concatenate the shards along the last dim; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_last(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _own_slice(g, ctx.comm), None


class _ScatterToTP(torch.autograd.Function):
    """Forward: this rank's slice along the last dim; backward: gather the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _own_slice(x, comm)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.comm), None


def _mark_shards(comm, *params) -> None:
    """Mark ``params`` as slices of a larger tensor split over ``comm`` (``hpctrain_tp_size``): whoever combines
    whole tensors (Adasum's dot products) can refuse them."""
    for p in params:
        if p is not None and comm.size > 1:
            p.hpctrain_tp_size = comm.size


def _shard_count(total: int, comm, what: str) -> int:
    if total % comm.size:
        raise ValueError(f"{what} = {total} is not divisible by the {comm.size} ranks of the tensor-parallel group")
    return total // comm.size


class ColumnParallelLinear(torch.nn.Module):
    """``nn.Linear(in_features, out_features)`` with the output features split over ``tp_comm``.

    Args:
        in_features, out_features: the full layer's sizes (``out_features``
            divisible by the group size).
        tp_comm: the tensor-parallel communicator.
        bias: whether the layer has a bias (split like the outputs).
        gather_output: all-gather the output (else each rank returns its slice).
    """

    def __init__(self, in_features: int, out_features: int, tp_comm, bias: bool = True,
                 gather_output: bool = False):
        super().__init__()
        self.comm, self.gather_output = tp_comm, gather_output
        self.in_features, self.out_features = in_features, out_features
        local = _shard_count(out_features, tp_comm, "out_features")
        self.weight = torch.nn.Parameter(torch.empty(local, in_features))
        self.bias = torch.nn.Parameter(torch.zeros(local)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))   # use from_linear for a shared init
        _mark_shards(tp_comm, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, tp_comm, gather_output: bool = False) -> "ColumnParallelLinear":
        """This rank's shard of ``linear`` (every rank passes the same layer)."""
        layer = cls(linear.in_features, linear.out_features, tp_comm, linear.bias is not None, gather_output)
        rows = slice(tp_comm.rank * layer.weight.shape[0], (tp_comm.rank + 1) * layer.weight.shape[0])
        with torch.no_grad():
            layer.weight.copy_(linear.weight[rows])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_CopyToTP.apply(x, self.comm), self.weight, self.bias)
        return _GatherFromTP.apply(y, self.comm) if self.gather_output else y


class RowParallelLinear(torch.nn.Module):
    """``nn.Linear(in_features, out_features)`` with the input features split over ``tp_comm``.

    Args:
        in_features, out_features: the full layer's sizes (``in_features``
            divisible by the group size).
        tp_comm: the tensor-parallel communicator.
        bias: whether the layer has a bias (whole on every rank, added once
            after the all-reduce).
        input_is_parallel: the input is already this rank's slice (the output
            of a :class:`ColumnParallelLinear`); else it is split here.
    """

    def __init__(self, in_features: int, out_features: int, tp_comm, bias: bool = True,
                 input_is_parallel: bool = True):
        super().__init__()
        self.comm, self.input_is_parallel = tp_comm, input_is_parallel
        self.in_features, self.out_features = in_features, out_features
        local = _shard_count(in_features, tp_comm, "in_features")
        self.weight = torch.nn.Parameter(torch.empty(out_features, local))
        self.bias = torch.nn.Parameter(torch.zeros(out_features)) if bias else None
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        _mark_shards(tp_comm, self.weight)          # (the bias is whole on every rank)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, tp_comm, input_is_parallel: bool = True) -> "RowParallelLinear":
        """This rank's shard of ``linear`` (every rank passes the same layer)."""
        layer = cls(linear.in_features, linear.out_features, tp_comm, linear.bias is not None, input_is_parallel)
        cols = slice(tp_comm.rank * layer.weight.shape[1], (tp_comm.rank + 1) * layer.weight.shape[1])
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, cols])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _ScatterToTP.apply(x, self.comm)
        y = _ReduceFromTP.apply(F.linear(x, self.weight), self.comm)
        return y + self.bias if self.bias is not None else y


class ParallelMLP(torch.nn.Module):
    """Transformer MLP block ``Linear(h, f) -> GELU -> Linear(f, h)``, column- then row-parallel.

    One all-reduce of the output in forward and one of the input gradient in
    backward; each rank holds ``2 h f / t`` weights.
    """

    def __init__(self, hidden: int, ffn: int, tp_comm):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn, tp_comm)
        self.fc2 = RowParallelLinear(ffn, hidden, tp_comm)

    @classmethod
    def from_linears(cls, fc1: torch.nn.Linear, fc2: torch.nn.Linear, tp_comm) -> "ParallelMLP":
        """Shard a single-process ``fc1 -> GELU -> fc2``."""
        block = cls.__new__(cls)
        torch.nn.Module.__init__(block)
        block.fc1 = ColumnParallelLinear.from_linear(fc1, tp_comm)
        block.fc2 = RowParallelLinear.from_linear(fc2, tp_comm)
        return block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelSelfAttention(torch.nn.Module):
    """Multi-head self-attention with the heads split over the group (``heads`` divisible by its size).

    Q, K and V are column-parallel (each rank computes its heads), attention
    runs on the local heads, and the output projection is row-parallel: one
    all-reduce in forward and one in backward, as the MLP block.  Input and
    output: ``[batch, tokens, hidden]``; ``causal`` masks future tokens.
    """

    def __init__(self, hidden: int, heads: int, tp_comm, causal: bool = False):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden = {hidden} is not divisible by heads = {heads}")
        _shard_count(heads, tp_comm, "heads")
        self.heads, self.head_dim, self.causal, self.comm = heads, hidden // heads, causal, tp_comm
        self.q = ColumnParallelLinear(hidden, hidden, tp_comm)
        self.k = ColumnParallelLinear(hidden, hidden, tp_comm)
        self.v = ColumnParallelLinear(hidden, hidden, tp_comm)
        self.out = RowParallelLinear(hidden, hidden, tp_comm)

    @classmethod
    def from_linears(cls, q, k, v, out, heads: int, tp_comm, causal: bool = False) -> "ParallelSelfAttention":
        """Shard single-process projections ``q, k, v, out`` (``nn.Linear(hidden, hidden)`` each)."""
        block = cls(q.in_features, heads, tp_comm, causal)
        block.q, block.k, block.v = (ColumnParallelLinear.from_linear(m, tp_comm) for m in (q, k, v))
        block.out = RowParallelLinear.from_linear(out, tp_comm)
        return block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        local = self.heads // self.comm.size

        def split(y):
            return y.view(b, t, local, self.head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)),
                                             is_causal=self.causal)
        return self.out(att.transpose(1, 2).reshape(b, t, local * self.head_dim))
