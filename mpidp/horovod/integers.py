"""Horovod's integer tensors on mpidp: the narrow dtypes mpidp's collectives do not carry
(uint8, int8, int16, bool) travel widened to int32 and come back in their own dtype, and an
integer tensor is scaled (``prescale_factor``, ``postscale_factor``, ``Average``) as Horovod
scales it (Note [Horovod's integer scaling])."""
from __future__ import annotations

import torch

from .. import runtime
from .basics import Average, Sum

# Note [Horovod's integer scaling]
# Horovod scales a buffer element by element as ``output[i] = scale_factor * input[i]`` in
# C++ (horovod/common/ops/collective_operations.h, ScaleBufferCPUImpl): for an integer
# dtype the product is a double, stored back truncated toward zero. ``Average`` is a Sum
# whose postscale factor is divided by the set's size (mpi_operations.cc), so an integer
# average is one truncation of ``sum * postscale / size``, never a refusal; the prescale
# factor is applied, and truncated, before the sum. mpidp reduces integers exactly (int32,
# int64), so the same truncations give Horovod's result. The narrow dtypes travel as int32
# but are prescaled, summed and postscaled in their own dtype as in Horovod: the prescaled
# value is cast to it and back before the sum, and the sum cast to it (wrapping as Horovod's
# sum wraps) before the postscale (uint8 200 and 200 averaged at 2 ranks: 72, Horovod's).

NARROW = (torch.uint8, torch.int8, torch.int16, torch.bool)


def widened(t: torch.Tensor) -> torch.Tensor:
    """``t``, as int32 where its dtype is one mpidp's collectives do not carry."""
    return t.to(torch.int32) if t.dtype in NARROW else t


def narrowed(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (``widened``'s result through a collective) back in ``dtype``."""
    return out if out.dtype == dtype else out.to(dtype)


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x`` times ``factor`` in place, as Horovod scales (Note [Horovod's integer
    scaling])."""
    if factor != 1.0:
        if x.is_floating_point() or x.is_complex():
            x.mul_(factor)
        else:
            x.copy_(x.double().mul_(factor))  # truncated toward zero, as C++ stores it
    return x


def as_reduced(tensor: torch.Tensor, op: int, postscale: float) -> tuple:
    """(op, postscale) to reduce ``tensor`` with on the current group: an integer Average is
    a Sum whose postscale is divided by the group's size (Note [Horovod's integer
    scaling])."""
    if op == Average and not (tensor.is_floating_point() or tensor.is_complex()):
        return Sum, postscale / runtime.group().size
    return op, postscale
