"""Communication hooks of DistributedDataParallel (mpidp.ddp.distributed) with torch's contract:
``hook(state, bucket) -> torch.futures.Future[Tensor]``, the bucket a ``GradBucket`` with
torch's methods (Note [Communication hooks]).

Note [Communication hooks]
With a hook registered, a bucket's gradients are copied into a torch tensor of the bucket's
size, kept from step to step (a hook may resize it, as batched PowerSGD does, so it is torch's
own, not a view of the bucket), the hook is called on DDP's communication thread with the
bucket (its index in launch order, that tensor as ``buffer()``, per-parameter views of it as
``gradients()``, the parameters, ``is_last``), and the tensor its future yields — the average
over the ranks, by torch's contract — is copied into the bucket and unpacked into the
gradients (with gradient_as_bucket_view the gradients are views of the bucket already). This
never takes the zero-copy path: a hook takes one flat tensor. torch's hooks
(``default_hooks.allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook``, ``batched_powerSGD_hook``) communicate through torch.distributed, so they
need it initialised — on the mpidp backend they run on mpidp's collectives, on a group of
their own (Note [Sub-groups] in mpidp/runtime/world.py). A joined rank (Note [Uneven inputs] in
mpidp/ddp/join.py) calls the hook with a zero buffer, as torch's DDP does. Every rank must
register the same hook with a state that agrees: at the first synchronised backward (or its
shadow under Join) the ranks compare whether one is registered, then ``describe_hook`` — the
hook's name (a functools.partial's function, arguments and keywords), its state's type and
what the hook declares of its state (``hook.mpidp_describe_state(state)``: mpidp's PowerSGD
settings), or else the settings of torch's PowerSGDState the state has (``POWERSGD_SETTINGS``,
its generator's state) — a MismatchError on every rank naming the first difference otherwise,
before any bucket is reduced."""
from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..engine.dtypes import F32

# Note [Hook capabilities]
# DistributedDataParallel knows a communication hook by what the hook declares, never by
# importing it and comparing: a hook function may carry
#   mpidp_check_state(state)     checks the state it is registered with (register_comm_hook);
#   mpidp_describe_state(state)  what of its state every rank must hold alike (PowerSGD's
#                                settings), compared at the first synchronised backward;
#   mpidp_attach(state, ddp)     called once at registration (ZeRO attaches to the model);
#   mpidp_wire                   a 16-bit dtype code: float32 buckets go over mpidp's fused
#                                cast-and-reduce path in that dtype (Note [Compressed buckets]
#                                in mpidp/ddp/compression.py) instead of calling the hook;
#   mpidp_reduce_scatter         True: each bucket is reduce-scattered, every rank keeping its
#                                block of the average (Note [ZeRO] in mpidp/ddp/zero.py).
# torch's hooks and users' declare none of these and are called as torch's contract says.


class GradBucket:
    """torch's ``dist.GradBucket`` for one of DDP's buckets."""

    def __init__(self, index: int, buffer: torch.Tensor, params: Sequence[torch.Tensor],
                 offsets: Sequence[int], is_last: bool):
        self._index, self._buffer, self._params = index, buffer, list(params)
        self._offsets, self._is_last = tuple(offsets), is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list:
        """Views of the buffer shaped as the parameters (writing them writes the buffer)."""
        return [self._buffer[o:o + p.numel()].view(p.shape)
                for o, p in zip(self._offsets, self._params)]

    def parameters(self) -> list:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor


def check_hook(state: Any, hook: Callable) -> None:
    """TypeError unless ``hook`` can be called as ``hook(state, bucket)``."""
    if not callable(hook):
        raise TypeError(f"register_comm_hook: hook must be callable as hook(state, bucket), "
                        f"got {type(hook).__name__}")
    check_state = getattr(hook, "mpidp_check_state", None)  # mpidp's own hooks check theirs
    if check_state is not None:
        check_state(state)


# What of a hook's state every rank must hold alike where the hook declares nothing (Note
# [Communication hooks]): the settings of torch's PowerSGDState, by name, on any state that has
# them — with another rank, schedule or batching the ranks would pair different all-reduces —
# and its generator (torch's random_seed is kept only as the generator it seeded).
POWERSGD_SETTINGS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                     "orthogonalization_epsilon", "use_error_feedback", "warm_start",
                     "batch_tensors_with_same_shape", "random_seed", "iter")


def describe_hook(state: Any, hook: Callable) -> list:
    """(label, value) pairs every rank's registered hook must agree on (Note [Communication
    hooks]), for fingerprint.check_same: the hook's function (and a functools.partial's
    arguments), its state's type, and what the hook declares of its state
    (``mpidp_describe_state``) or else the PowerSGD settings the state has."""
    target = getattr(hook, "func", hook)  # a functools.partial: the function it wraps
    name = getattr(target, "__qualname__", type(target).__qualname__)
    out = [("communication hook", f"{getattr(target, '__module__', '')}.{name}")]
    if isinstance(hook, functools.partial):
        out += [("communication hook arguments", tuple(hook.args)),
                ("communication hook keywords", dict(hook.keywords))]
    out.append(("communication hook state", type(state).__qualname__))
    describe = getattr(hook, "mpidp_describe_state", None)  # mpidp's own hooks describe theirs
    if describe is not None:
        return out + [(f"communication hook state: {label}", value) for label, value in
                      describe(state)]
    out += [(f"communication hook state: {name}", getattr(state, name))
            for name in POWERSGD_SETTINGS if hasattr(state, name)]
    rng = getattr(state, "rng", None)  # torch's PowerSGDState: a seeded numpy RandomState
    if isinstance(rng, np.random.RandomState):
        digest = hashlib.sha256(rng.get_state()[1].tobytes()).hexdigest()[:16]
        out.append(("communication hook state: rng (its state's digest)", digest))
    return out


def run_hook(state: Any, hook: Callable, bucket, sources: Sequence[Any],
             destinations, params: Sequence[torch.Tensor], index: int, is_last: bool,
             buffers: dict) -> None:
    """Note [Communication hooks]: ``sources`` copied into the bucket's hook buffer (None:
    zeros), ``hook`` called, its result copied into the bucket and unpacked into
    ``destinations`` (None: the gradients are views of the bucket). ``buffers`` keeps each
    bucket's hook buffer between steps. Collective, as the hook's communication is."""
    count = sum(bucket.counts)
    like = params[0] if params else torch.empty(0)
    buffer = buffers.get(index)
    if buffer is None or buffer.dtype != like.dtype or buffer.device != like.device:
        buffer = buffers[index] = torch.empty(count, dtype=like.dtype, device=like.device)
    elif not buffer.untyped_storage().resizable():  # something took a .numpy() view of it
        buffer = buffers[index] = torch.empty(count, dtype=like.dtype, device=like.device)
    elif buffer.numel() != count:  # a hook may resize it (batched PowerSGD pads it)
        buffer.resize_(count)
    with bucket.stream_context(), torch.no_grad():  # on a GPU: the gradients' stream
        _copy_in(buffer, sources, bucket)
        future = hook(state, GradBucket(index, buffer, params, bucket.offsets, is_last))
        result = _result(hook, future, count)
        bucket.torch_flat(like.dtype).copy_(result.reshape(-1)[:count])
    bucket.divisor = 1  # the hook averaged; unpack_one of an unused parameter divides by 1
    if destinations is not None:
        bucket.unpack(destinations, 1)


def _copy_in(buffer: torch.Tensor, sources: Sequence[Any], bucket) -> None:
    """The gradients ``sources`` (None: zeros) into the hook's flat ``buffer``."""
    for s, o, c in zip(sources, bucket.offsets, bucket.counts):
        if s is None:
            buffer[o:o + c].zero_()
        else:
            buffer[o:o + c].copy_(s.reshape(-1))


def _result(hook: Callable, future, count: int) -> torch.Tensor:
    """The flat tensor ``hook``'s ``future`` yields, checked against torch's contract."""
    if not callable(getattr(future, "wait", None)):  # torch.futures.Future or torch._C's
        raise TypeError(f"the communication hook {getattr(hook, '__name__', hook)!r} returned "
                        f"{type(future).__name__}; torch's contract is a "
                        "torch.futures.Future of the bucket's averaged tensor")
    result = future.wait()
    if isinstance(result, (list, tuple)):
        result = result[0]
    if result.numel() < count:
        raise ValueError(f"the communication hook returned {result.numel()} elements for a "
                         f"bucket of {count}")
    return result


def fused_wire(hook: Any, bucket) -> Optional[int]:
    """The 16-bit dtype code ``bucket`` goes over on the fused path with ``hook`` (Note [Hook
    capabilities]: ``mpidp_wire``), or None where it takes the hook function (another hook, a
    bucket of another dtype)."""
    wire = getattr(hook, "mpidp_wire", None)
    return wire if wire is not None and bucket.dtype == F32 else None


def reduce_scatters(hook: Any) -> bool:
    """Whether ``hook``'s buckets are reduce-scattered (Note [Hook capabilities])."""
    return bool(getattr(hook, "mpidp_reduce_scatter", False))


def attach(state: Any, hook: Callable, ddp: Any) -> None:
    """Registration's call of the hook's ``mpidp_attach`` where it declares one (Note [Hook
    capabilities])."""
    attach_to = getattr(hook, "mpidp_attach", None)
    if attach_to is not None:
        attach_to(state, ddp)
