"""mpidp's own compression hooks for DistributedDataParallel, with torch's hook contract and
no torch.distributed: ``fp16_compress_hook`` and ``bf16_compress_hook`` here, PowerSGD in
mpidp.ddp.powersgd (Note [Compressed buckets]).

Note [Compressed buckets]
Each hook is defined by what it returns: fp16 — every rank's gradient divided by the number
of ranks N in float32 and rounded once to float16 (dividing before the sum keeps it in
float16's range, as torch's hook does; torch rounds first and divides in float16, a second
rounding), summed in float16, widened to float32; bf16 — every gradient rounded once to
bfloat16 (float32's range: no need to divide first; torch's divides before the sum), summed in
bfloat16, widened and divided by N in float32: the bf16-rounded average. The hook functions compute
exactly that with torch casts and mpidp's all-reduce, so they run wherever a hook runs (on a
GPU bucket, or on torch's own DDP under mpiexec). On mpidp's DDP a float32 host bucket takes
the fused path instead (``Bucket.reduce_cast_``): the gradients are packed straight into a
16-bit bucket with the conversion and division in the same C pass, the 16-bit bucket is
all-reduced, and the unpack widens (and divides) into the gradients — no float32 bucket, no
separate cast; half the bytes on the wire. A GPU bucket does the same with one CUDA launch
per cast (``mpidp_cast_*`` in mpidp/engine/gpu/kernels/pack.cu, its element math tested against the C
extension's on the host). Both paths give the same bits (tested) with DDP's default
algorithm, auto; with another one the fused path's all-reduce uses it, the hook function (which
cannot see it) auto."""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..comm import collectives
from .. import runtime
from ..engine.dtypes import BF16, F16


def _check_state(state: Any, name: str) -> None:
    if state is not None:
        raise TypeError(f"mpidp's {name} averages over DistributedDataParallel's ranks and "
                        f"takes no state: register_comm_hook(None, {name}); got "
                        f"{type(state).__name__}")


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(tensor)
    return future


def fp16_compress_hook(state: None, bucket) -> torch.futures.Future:
    """The bucket averaged over a float16 wire (Note [Compressed buckets])."""
    _check_state(state, "fp16_compress_hook")
    buffer = bucket.buffer()
    wire = (buffer / runtime.size()).to(torch.float16)
    collectives.allreduce_(wire, "sum")
    return _done(wire.to(buffer.dtype))


def bf16_compress_hook(state: None, bucket) -> torch.futures.Future:
    """The bucket averaged over a bfloat16 wire: the bf16-rounded average (Note [Compressed
    buckets])."""
    _check_state(state, "bf16_compress_hook")
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16)
    collectives.allreduce_(wire, "sum")
    return _done(wire.to(buffer.dtype) / runtime.size())


for _hook, _wire in ((fp16_compress_hook, F16), (bf16_compress_hook, BF16)):
    _hook.mpidp_wire = _wire  # type: ignore[attr-defined]
    _hook.mpidp_check_state = functools.partial(  # type: ignore[attr-defined]
        _check_state, name=_hook.__name__)
