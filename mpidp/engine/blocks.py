"""The block rule: how ``count`` elements split into ``parts`` blocks, one per rank. The ring's
chunks, the reduce-scatter's blocks, ZeRO's shards and the parameter server's shard map are all
cut by ``partition``, so a block of one is the block of the other."""
from __future__ import annotations

from typing import Tuple

Span = Tuple[int, int]  # (offset, count) in elements


def partition(count: int, parts: int, unit: int = 1) -> Tuple[Span, ...]:
    """Splits ``count`` elements into ``parts`` spans as ``numpy.array_split`` splits
    ``count // unit`` rows of ``unit`` elements: the first ``rows % parts`` spans get one row
    more."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if unit < 1 or count % unit:
        raise ValueError(f"count {count} is not a multiple of unit {unit}")
    rows = count // unit
    base, extra = divmod(rows, parts)
    spans, offset = [], 0
    for i in range(parts):
        n = (base + (i < extra)) * unit
        spans.append((offset, n))
        offset += n
    return tuple(spans)
