"""Horovod's reducescatter and grouped_reducescatter, their ``_async`` forms, and their
gradient as Horovod defines it, on mpidp's reduce_scatter."""
from __future__ import annotations

import torch

from ..comm import collectives
from ..engine.header import REDUCE_SCATTER
from .arguments import checked, named
from .basics import Average, Max, Min, Sum
from .compression import Compression
from .integers import as_reduced, narrowed, scaled, widened
from .ops import _async, allgather
from .process_sets import on

_MPIDP_OP = {Average: "avg", Sum: "sum", Min: "min", Max: "max"}


class _Reducescatter(torch.autograd.Function):
    """Horovod's gradient: every rank's gradient gathered, times the set's size for Sum, and
    times the factors (an Average's gradient is not divided: Horovod's)."""

    @staticmethod
    def forward(ctx, tensor, op, process_set, prescale, postscale):
        ctx.args = (op, process_set, prescale, postscale)
        with torch.no_grad(), on(process_set):
            op, postscale = as_reduced(tensor, op, postscale)
            x = scaled(widened(tensor.detach()).clone(memory_format=torch.contiguous_format),
                       prescale)
            out = scaled(collectives.reduce_scatter(x, _MPIDP_OP[op]), postscale)
            return narrowed(out, tensor.dtype)

    @staticmethod
    def backward(ctx, grad):
        op, process_set, prescale, postscale = ctx.args
        if op == Sum:
            with on(process_set) as g:
                grad = grad * g.size
        grad = grad * (prescale * postscale) if prescale * postscale != 1.0 else grad
        return allgather(grad, process_set=process_set), None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  process_set=None, prescale_factor=1.0, postscale_factor=1.0):
    """This rank's block (along dimension 0, the first ranks taking one row more where it
    does not divide) of the reduction of ``tensor`` over every rank; differentiable."""
    op = checked(tensor, op, None, process_set, REDUCE_SCATTER, "reducescatter",
                 (Average, Sum, Min, Max))
    compressed, ctx = compression.compress(tensor)
    with named(name, process_set, "reducescatter"):
        out = _Reducescatter.apply(compressed, op, process_set, float(prescale_factor),
                                   float(postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=None, prescale_factor=1.0, postscale_factor=1.0):
    """``reducescatter`` of each tensor of ``tensors``, in order; a list."""
    with named(name, process_set, "grouped_reducescatter"):
        return [reducescatter(t, compression=compression, op=op, process_set=process_set,
                              prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor) for t in tensors]


reducescatter_async = _async(reducescatter, "reducescatter_async")
grouped_reducescatter_async = _async(grouped_reducescatter, "grouped_reducescatter_async")
