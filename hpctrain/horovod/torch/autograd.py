"""Gradients of Horovod's torch collectives (the conventions of Horovod 0.28's own functions).

* allreduce: the same reduction (op and scale factors) of the output's gradient;
* allgather: the gradients averaged over the ranks, then this rank's rows;
* broadcast: the gradients averaged over the ranks on the root, zero elsewhere;
* alltoall: the gradients sent back with the received splits;
* reducescatter: the gradients gathered, times the ranks for Sum.
"""
from __future__ import annotations

import torch

from .. import basics
from ..requests import set_rank, set_size
from . import mpi_ops as ops


def _size(process_set) -> int:
    return set_size(process_set)


class HorovodAllreduce(torch.autograd.Function):
    """Differentiable allreduce."""

    @staticmethod
    def forward(ctx, tensor, op, name, pre, post, process_set):
        ctx.args = (op, pre, post, process_set)
        op_, restore = ops._allreduce_request(tensor, name, op, pre, post, process_set)
        return restore(op_.wait())

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set = ctx.args
        op_, restore = ops._allreduce_request(grad.contiguous(), None, op, pre, post, process_set)
        return restore(op_.wait()), None, None, None, None, None


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Differentiable grouped allreduce."""

    @staticmethod
    def forward(ctx, op, name, pre, post, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        op_, restores = ops._grouped_request(tensors, name, op, pre, post, process_set)
        return tuple(r(o) for r, o in zip(restores, op_.wait()))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        op_, restores = ops._grouped_request([g.contiguous() for g in grads], None, op, pre, post, process_set)
        return (None, None, None, None, None) + tuple(r(o) for r, o in zip(restores, op_.wait()))


def _gather_grad(grad, rows, process_set):
    """Average ``grad`` over the ranks and return this rank's ``rows`` of it."""
    reduced = ops.allreduce(grad.contiguous(), op=0, process_set=process_set)
    counts = ops.allgather(torch.tensor([rows], dtype=torch.int64), process_set=process_set)
    offset = int(counts[:set_rank(process_set)].sum())
    return reduced.narrow(0, offset, rows)


class HorovodAllgather(torch.autograd.Function):
    """Differentiable allgather."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0] if tensor.dim() else 1, process_set
        return ops.synchronize(ops.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        return _gather_grad(grad, ctx.rows, ctx.process_set), None, None


class HorovodGroupedAllgather(torch.autograd.Function):
    """Differentiable grouped allgather."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(ops.synchronize(ops.grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(_gather_grad(g, r, ctx.process_set) for g, r in zip(grads, ctx.rows))


class HorovodBroadcast(torch.autograd.Function):
    """Differentiable broadcast."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = ops.allreduce(grad.contiguous(), op=0, process_set=ctx.process_set)
        if basics.rank() != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


class HorovodAlltoall(torch.autograd.Function):
    """Differentiable alltoall (returns the received rows and splits)."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = ops.synchronize(ops.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _):
        back, _ = ops.synchronize(ops.alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set))
        return back, None, None, None


class HorovodReducescatter(torch.autograd.Function):
    """Differentiable reduce-scatter."""

    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, process_set):
        ctx.op, ctx.process_set = op, process_set
        return ops.synchronize(ops.reducescatter_async(tensor, name, _op_id(op), pre, post, process_set))

    @staticmethod
    def backward(ctx, grad):
        gathered = ops.synchronize(ops.allgather_async(grad.contiguous(), None, ctx.process_set))
        if ctx.op == "sum":
            gathered = gathered * _size(ctx.process_set)
        return gathered, None, None, None, None, None


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Differentiable grouped reduce-scatter."""

    @staticmethod
    def forward(ctx, name, op, pre, post, process_set, *tensors):
        ctx.op, ctx.process_set = op, process_set
        return tuple(ops.synchronize(ops.grouped_reducescatter_async(tensors, name, _op_id(op), pre, post,
                                                                    process_set)))

    @staticmethod
    def backward(ctx, *grads):
        outs = ops.synchronize(ops.grouped_allgather_async([g.contiguous() for g in grads], None,
                                                           ctx.process_set))
        scale = _size(ctx.process_set) if ctx.op == "sum" else 1
        return (None, None, None, None, None) + tuple(o * scale for o in outs)


def _op_id(op: str) -> int:
    """Horovod's op constant for hpctrain's op name."""
    return {v: k for k, v in basics._OP_NAMES.items()}[op]
