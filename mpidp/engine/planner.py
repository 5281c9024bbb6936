"""The one decision of how a bucket of tensors is all-reduced — zero-copy or packed, which
algorithm, where the average divides — as a pure function over mpidp.algorithms' table.
Buckets (mpidp.comm.buckets) and grouped_allreduce (mpidp.comm.fusion) ask it; nothing else decides."""
from __future__ import annotations

from typing import NamedTuple, Optional

from ..algorithms import DEVICE, HOST, Algorithm, Facts, choose

__all__ = ["DEVICE", "HOST", "BucketPlan", "max_tensors", "plan_bucket"]


class BucketPlan(NamedTuple):
    algorithm: Algorithm
    zero_copy: bool           # reduced where the tensors lie (Note [Zero-copy buckets])
    divide_in_unpack: bool    # the average's division rides in the unpack, not the all-reduce


def plan_bucket(where: str, algorithm: str, facts: Facts, nbytes: int, ntensors: int,
                in_place: bool, op: str) -> BucketPlan:
    """How one bucket of ``ntensors`` tensors (``nbytes`` in all) is all-reduced: which
    algorithm, whether without packing (in place, on shm, above the inline size, at most
    ``max_segments`` tensors: Note [Zero-copy buckets] in mpidp/comm/buckets.py), and whether the
    average divides in the unpack (everywhere but on shm, where the slice owners divide)."""
    row = choose(where, algorithm, facts, nbytes)
    shm = row.name == "shm" and facts.size > 1
    zero_copy = shm and in_place and facts.inline_bytes < nbytes and \
        0 < ntensors <= facts.max_segments
    return BucketPlan(row, zero_copy, op == "avg" and not shm)


def max_tensors(where: str, algorithm: str, facts: Facts, cap_bytes: int,
                in_place: bool) -> Optional[int]:
    """The most tensors a bucket of up to ``cap_bytes`` may hold so that it can go zero-copy
    (None: no limit, it will be packed anyway)."""
    row = choose(where, algorithm, facts, cap_bytes)
    if where == HOST and in_place and row.name == "shm" and facts.size > 1:
        return facts.max_segments
    return None
