"""SyncBatchNorm: batch normalization with statistics over the whole global batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, mean and var over every rank's batch.

    Forward all-gathers each rank's (count, mean, M2) per channel and combines
    them with the parallel-variance formula (Chan et al.):
    ``mean = sum(n_r mean_r) / n``, ``M2 = sum(M2_r + n_r (mean_r - mean)^2)``,
    ``var = M2 / n`` — stable, and identical on every rank.  Backward all-reduces
    ``sum(dy)`` and ``sum(dy * xhat)`` per channel and returns
    ``dx = weight / sqrt(var + eps) / n * (n dy - sum(dy) - xhat sum(dy xhat))``.
    Cost: one all-gather of (2C+1) floats in forward, one all-reduce of 2C in backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, comm, eps):
        dims = [0] + list(range(2, x.dim()))
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = xf.numel() // xf.shape[1]
        mean_r = xf.mean(dims) if count else torch.zeros(xf.shape[1], dtype=xf.dtype, device=xf.device)
        m2_r = ((xf - _expand(mean_r, xf)) ** 2).sum(dims)
        local = torch.cat([torch.tensor([float(count)], dtype=xf.dtype, device=xf.device), mean_r, m2_r]).unsqueeze(0)
        table = comm.allgather(local.detach())
        counts, means, m2s = table[:, :1], table[:, 1:1 + xf.shape[1]], table[:, 1 + xf.shape[1]:]
        n = counts.sum()
        if n == 0:
            raise ValueError("SyncBatchNorm got an empty batch on every rank")
        mean = (counts * means).sum(0) / n
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        var = m2 / n
        invstd = torch.rsqrt(var + eps)
        xhat = (xf - _expand(mean, xf)) * _expand(invstd, xf)
        y = xhat
        if weight is not None:
            y = y * _expand(weight.to(xf.dtype), xf) + _expand(bias.to(xf.dtype), xf)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.comm, ctx.n, ctx.dims = comm, n, dims
        ctx.mark_non_differentiable(mean, var)
        return y.to(x.dtype), mean, m2 / torch.clamp(n - 1, min=1)

    @staticmethod
    def backward(ctx, dy, _dmean, _dvar):
        xhat, invstd, weight = ctx.saved_tensors
        dyf = dy.to(xhat.dtype)
        sum_dy_local = dyf.sum(ctx.dims)
        sum_dy_xhat_local = (dyf * xhat).sum(ctx.dims)
        both = ctx.comm.allreduce(torch.cat([sum_dy_local, sum_dy_xhat_local]))
        c = xhat.shape[1]
        sum_dy, sum_dy_xhat = both[:c], both[c:]
        scale = invstd if weight is None else invstd * weight.to(xhat.dtype)
        dx = _expand(scale / ctx.n, xhat) * (ctx.n * dyf - _expand(sum_dy, xhat) - xhat * _expand(sum_dy_xhat, xhat))
        dw = db = None
        if weight is not None:
            dw, db = sum_dy_xhat_local.to(weight.dtype), sum_dy_local.to(weight.dtype)
        return dx.to(dy.dtype), dw, db, None, None


def _expand(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (like.dim() - 2))


class SyncBatchNorm(_BatchNorm):
    """Batch normalization whose training statistics cover the batches of all ranks.

    Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (inputs ``(N, C, ...)``).  In
    training the mean and variance are those of the concatenation of every
    rank's batch, so N ranks with batch B behave like one process with batch
    N*B; in eval mode it is plain batch norm with the running statistics.
    Every rank must call forward (and backward) the same number of times.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as in
            ``torch.nn.BatchNorm2d``.
        comm: the communicator to normalize over (default: the world).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum=0.1, affine: bool = True,
                 track_running_stats: bool = True, comm=None, device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.comm = comm

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of shape (N, C, ...), got {tuple(x.shape)}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x`` with global batch statistics in training, running statistics in eval."""
        self._check_input_dim(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        comm = self.comm
        if comm is None:
            from .. import world
            comm = world()
        y, mean, unbiased_var = _SyncBatchNormFunction.apply(x, self.weight, self.bias, comm, self.eps)
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum)
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)
        return y


def convert_sync_batchnorm(module: torch.nn.Module, comm=None) -> torch.nn.Module:
    """Return ``module`` with every BatchNorm layer replaced by a :class:`SyncBatchNorm` (weights kept)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, comm=comm)
        with torch.no_grad():
            if module.affine:
                new.weight.copy_(module.weight)
                new.bias.copy_(module.bias)
                new.weight.requires_grad_(module.weight.requires_grad)
                new.bias.requires_grad_(module.bias.requires_grad)
            if module.track_running_stats:
                new.running_mean.copy_(module.running_mean)
                new.running_var.copy_(module.running_var)
                new.num_batches_tracked.copy_(module.num_batches_tracked)
        new.to(next(module.buffers(), next(module.parameters(), torch.empty(0))).device)
        new.train(module.training)
        return new
    for name, child in list(module.named_children()):
        setattr(module, name, convert_sync_batchnorm(child, comm))
    return module
