"""Fingerprints compared across ranks once, where a training mode is built: the model
(parameter and buffer names, shapes, dtypes) and the gradient bucket layout. A difference is
a MismatchError on every rank naming each rank that differs and how, before any collective
could pair different buffers (per-collective fingerprints: Note [Debug fingerprints] in
mpidp/engine/header.py)."""
from __future__ import annotations

from typing import Any, Sequence

from ..engine.dtypes import DTYPE_NAMES
from ..errors import MismatchError
from ..runtime.frame import collective


def check_same_model(g, module: Any, who: str) -> None:
    """Parameter and buffer names, shapes and dtypes of ``module`` must agree on every rank of
    group ``g``; a MismatchError naming the first difference of each rank otherwise, raised on
    every rank (``who`` names the caller in the message). Every rank calls it."""
    mine = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
            for n, p in module.named_parameters()]
    mine += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in module.named_buffers()]
    with collective(g, f"{who}: model check"):
        everyone = g.comm.allgather(mine) if g.size > 1 else [mine]

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
    with collective(g, f"{who}: bucket layout check"):
        everyone = g.comm.allgather(mine) if g.size > 1 else [mine]

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
