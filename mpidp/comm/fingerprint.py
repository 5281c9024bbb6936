"""Fingerprints compared across ranks once, where a training mode is built: the model
(parameter and buffer names, shapes, dtypes), the gradient bucket layout, and any other
description every rank must hold alike (``check_same``: ZeRO's parameters and groups, a
communication hook and its state, Join's settings). A difference is a MismatchError on every
rank naming each rank that differs and how, before any collective could pair different
buffers (per-collective fingerprints: Note [Debug fingerprints] in mpidp/engine/header.py)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..engine.dtypes import DTYPE_NAMES
from ..errors import MismatchError
from . import agreement, objects


def check_same_model(g, module: Any, who: str) -> None:
    """Parameter and buffer names, shapes and dtypes of ``module`` must agree on every rank of
    group ``g``; a MismatchError naming the first difference of each rank otherwise, raised on
    every rank (``who`` names the caller in the message). Every rank calls it."""
    mine = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
            for n, p in module.named_parameters()]
    mine += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    everyone = objects.allgather(g, mine, f"{who}: model check")

    def text(entry):
        kind, name, shape, dtype, grad = entry
        return f"{kind} {name} {dtype}{list(shape)}" + ("" if grad or kind == "buffer" else
                                                         " (requires_grad=False)")
    lines = []
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs == everyone[0]:
            continue
        if len(theirs) != len(everyone[0]):
            lines.append(f"  rank {r}: {len(theirs)} parameters and buffers, rank 0 has "
                         f"{len(everyone[0])}")
        diff = next(((a, b) for a, b in zip(everyone[0], theirs) if a != b), None)
        if diff is not None:
            lines.append(f"  rank {r}: {text(diff[1])} where rank 0 has {text(diff[0])}")
    if lines:
        raise MismatchError(f"rank {g.rank}: {who}: the model differs between "
                            "ranks; every rank raises this error:\n" + "\n".join(lines))


def check_same_buckets(g, buckets: Sequence[Any], who: str) -> None:
    """The fingerprint of a bucket layout — each bucket's dtype, tensor count and element
    count, in launch order — must agree on every rank of ``g`` (every bucket is one
    collective, so a difference would pair different buffers); a MismatchError naming each
    rank that differs and its first differing bucket otherwise, on every rank. Every rank
    calls it when it builds buckets."""
    mine = [(b.dtype, len(b.counts), sum(b.counts)) for b in buckets]
    everyone = objects.allgather(g, mine, f"{who}: bucket layout check")

    def text(layout, k):
        if k >= len(layout):
            return f"no bucket {k + 1} ({len(layout)} buckets)"
        dtype, tensors, count = layout[k]
        return f"bucket {k + 1} of {len(layout)}: {tensors} tensors, {DTYPE_NAMES[dtype]}[{count}]"
    lines = []
    for r, theirs in enumerate(everyone[1:], start=1):
        if theirs != everyone[0]:
            k = next((k for k, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b),
                     min(len(theirs), len(everyone[0])))
            lines.append(f"  rank {r}: {text(theirs, k)} where rank 0 has "
                         f"{text(everyone[0], k)}")
    if lines:
        raise MismatchError(f"rank {g.rank}: {who}: the gradient buckets differ between ranks "
                            "(a different bucket size or parameter order on some rank); every "
                            "rank raises this error:\n" + "\n".join(lines))


# Note [Comparing descriptions]
# check_same compares (label, value) pairs by value, exactly: a float by its bits (float.hex,
# so a NaN equals itself), a tensor by its dtype, shape and bytes, a tuple, list or dict entry
# by entry, an object of another type by its repr where its type defines one, else by its type
# alone (a default repr names an address, which differs between processes). What is shown is
# the value's repr (a tensor's values in full precision, a string as it is).

def check_same(g, entries: Sequence[tuple], who: str, what: str,
               failed: Optional[BaseException] = None) -> None:
    """``entries`` — this rank's description of something every rank of group ``g`` must
    hold alike, as (label, value) pairs compared exactly (Note [Comparing descriptions]) —
    must be every rank's; a MismatchError otherwise, on every rank, naming for each rank that
    differs from rank 0 its first differing entry and rank 0's (``who`` names the caller,
    ``what`` the thing described, plural: "... differ between ranks"). ``failed``: this rank
    refused its input before it could describe it; it still joins the exchange, then raises
    ``failed`` while every other rank raises a MismatchError naming it — no rank waits.
    Every rank calls it, once, where the thing is built."""
    mine = [(str(label), _key(value), _shown(value)) for label, value in entries]
    refusal = None if failed is None else f"{type(failed).__name__}: {failed}"
    name = f"{who}: check of {what}"
    agreement.called(g, name)  # a rank in another collective raises here, on every rank
    everyone = objects.allgather(g, (refusal, mine), name)
    if failed is not None:
        raise failed
    refused = [f"  rank {r}: {err}" for r, (err, _) in enumerate(everyone) if err is not None]
    if refused:
        raise MismatchError(f"rank {g.rank}: {who}: refused on some ranks; every rank "
                            "raises an error:\n" + "\n".join(refused))
    first = [(label, key) for label, key, _ in everyone[0][1]]
    lines = []
    for r, (_, theirs) in enumerate(everyone[1:], start=1):
        if [(label, key) for label, key, _ in theirs] == first:
            continue
        k = next((k for k, (a, b) in enumerate(zip(everyone[0][1], theirs)) if a[:2] != b[:2]),
                 min(len(theirs), len(first)))
        a = theirs[k] if k < len(theirs) else None
        b = everyone[0][1][k] if k < len(first) else None
        if a is not None and b is not None and a[0] == b[0]:
            lines.append(f"  rank {r}: {a[0]} = {a[2]} where rank 0 has {b[2]}")
        else:
            lines.append(f"  rank {r}: {_entry(a)} where rank 0 has {_entry(b)}")
    if lines:
        raise MismatchError(f"rank {g.rank}: {who}: {what} differ between ranks; every rank "
                            "raises this error:\n" + "\n".join(lines))


def _entry(entry: Optional[tuple]) -> str:
    return "nothing more" if entry is None else f"{entry[0]} = {entry[2]}"


def _key(value: Any) -> Any:
    """``value`` in a form that compares across processes exactly (Note [Comparing
    descriptions])."""
    if isinstance(value, float):
        return ("float", value.hex())
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return (type(value).__name__, value)
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().reshape(-1).contiguous()
        return ("tensor", str(value.dtype), tuple(value.shape),
                data.view(torch.uint8).numpy().tobytes())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((repr(k), _key(v)) for k, v in value.items())))
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    return (kind, repr(value)) if type(value).__repr__ is not object.__repr__ else (kind,)


def _shown(value: Any, limit: int = 160) -> str:
    """``value`` as a message shows it (Note [Comparing descriptions])."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, torch.Tensor):
        text = f"tensor({value.detach().cpu().tolist()!r}, dtype={value.dtype})"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
