"""``SyncBatchNorm``: torch.nn.SyncBatchNorm computing the statistics of the global batch on
any device, CPU included (torch's own refuses CPU tensors), over mpidp's collectives or a
torch.distributed process group (Note [Synchronised batch statistics]).

Note [Synchronised batch statistics]
In training, every rank sums its batch per channel (element count, sum, sum of squares, in
float64) and the sums are all-reduced, so every rank normalises with the global mean and the
biased global variance, as BatchNorm on the concatenated batch would, and updates its running
statistics alike (the unbiased variance). Backward all-reduces the per-channel sums of dy and
of dy * x_hat, which the input gradient needs; the weight and bias gradients stay this rank's
own, which the data-parallel wrapper then averages (torch's SyncBatchNorm does the same).
Who all-reduces: the layer's ``reduce`` where a data-parallel wrapper set one (mpidp's
DistributedDataParallel orders these calls with its gradient buckets: Note [One communication
thread per group] in mpidp/comm/scheduler.py), or where the class has one (hvd.SyncBatchNorm's, in
order with DistributedOptimizer's buckets: Note [Gradients during backward] in
mpidp/horovod/backward.py); else torch.distributed on the layer's process group where
torch.distributed is initialised (its own order, on any backend); else mpidp's all-reduce. In eval mode nothing is communicated (as with torch's): the running
statistics, or without them this rank's batch."""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import collectives


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, reduce: Callable):
        dims = [0] + list(range(2, x.dim()))
        channels = x.shape[1]
        xd = x.detach().double()
        sums = torch.cat([torch.full((1,), x.numel() // max(channels, 1), dtype=torch.float64,
                                     device=x.device), xd.sum(dims), (xd * xd).sum(dims)])
        reduce(sums)
        count = sums[0]
        mean = sums[1:1 + channels] / count
        var = (sums[1 + channels:] / count - mean * mean).clamp_min(0)
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + eps)
        x_hat = ((xd - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        y = x_hat if weight is None else x_hat * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.reduce, ctx.dims, ctx.count = reduce, dims, count
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var, count

    @staticmethod
    def backward(ctx, dy, _mean, _var, _count):
        x_hat, invstd, weight = ctx.saved_tensors
        dims, channels = ctx.dims, x_hat.shape[1]
        shape = [1, channels] + [1] * (x_hat.dim() - 2)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * x_hat).sum(dims)
        both = torch.cat([sum_dy, sum_dy_xhat]).double()
        ctx.reduce(both)
        mean_dy = (both[:channels] / ctx.count).view(shape)
        mean_dy_xhat = (both[channels:] / ctx.count).view(shape)
        scale = invstd if weight is None else invstd * weight.double()
        dx = (scale.view(shape) * (dy.double() - mean_dy - x_hat.double() * mean_dy_xhat))
        dw = None if weight is None else sum_dy_xhat.to(weight.dtype)
        db = None if weight is None else sum_dy.to(weight.dtype)
        return dx.to(dy.dtype), dw, db, None, None


def _world_sum(t: torch.Tensor) -> None:
    collectives.allreduce_(t, "sum")


class SyncBatchNorm(_BatchNorm):
    """torch.nn.SyncBatchNorm's interface and state (its arguments, ``process_group``,
    ``convert_sync_batchnorm``); statistics of the global batch on any device (Note
    [Synchronised batch statistics]). Not a subclass of torch's, which torch's DDP refuses on
    CPU modules. Every rank runs its forward and backward in training together: each is a
    collective."""

    reduce: Optional[Callable] = None  # set by a data-parallel wrapper (mpidp's DDP)

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:  # running statistics, or this rank's batch: no communication,
            return F.batch_norm(input, self.running_mean, self.running_var,  # as torch's
                                self.weight, self.bias, self.running_mean is None, 0.0,
                                self.eps)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        y, mean, var, count = _SyncBatchNorm.apply(input, self.weight, self.bias, self.eps,
                                                   self._reducer())
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = var * (count / (count - 1).clamp_min(1))
                self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype),
                                                        alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype),
                                                       alpha=factor)
        return y

    def _reducer(self) -> Callable:
        if self.reduce is not None:
            return self.reduce
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            group = self.process_group
            return lambda t: dist.all_reduce(t, group=group)
        return _world_sum

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group=None):
        """Every BatchNorm*D (and torch.nn.SyncBatchNorm) layer of ``module`` as mpidp's
        SyncBatchNorm, sharing its parameters and running statistics (torch's
        convert_sync_batchnorm, then the class); returns the module, or the new layer where
        ``module`` itself is one."""
        converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
        for m in converted.modules():
            if type(m) is torch.nn.SyncBatchNorm:
                m.__class__ = cls  # the same state: both are torch's _BatchNorm
        return converted


def adopt(module: torch.nn.Module, reduce: Callable) -> list:
    """Makes every torch.nn.SyncBatchNorm layer of ``module`` mpidp's, all-reducing with
    ``reduce``; returns their names. ValueError naming a layer bound to a process group of its
    own (mpidp's DDP synchronises every rank of its group)."""
    names = []
    for name, m in module.named_modules():
        if not isinstance(m, (torch.nn.SyncBatchNorm, SyncBatchNorm)):
            continue
        if m.process_group is not None:
            raise ValueError(f"SyncBatchNorm layer {name!r} has process_group="
                             f"{m.process_group!r}: mpidp's DistributedDataParallel "
                             "synchronises batch statistics over all its ranks; build the "
                             "layer with process_group=None (or use mpidp.init(comm) for a "
                             "sub-communicator)")
        if type(m) is torch.nn.SyncBatchNorm:
            m.__class__ = SyncBatchNorm
        m.reduce = reduce
        names.append(name)
    return names
