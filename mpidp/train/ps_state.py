"""The parameter server's optimizer state in checkpoints, re-cut for another number of servers
(Note [Resuming on another number of ranks] in setup.py). Pure: set-up checks a checkpoint
with it before any rank commits to the run, the strategy loads with it."""
from __future__ import annotations

import torch

from ..engine.blocks import partition


def reshard_optimizer_states(states: list, servers: int, total: int) -> list:
    """The optimizer states of ``len(states)`` servers (their state_dicts, in server order,
    each over one flat shard parameter: ps.shard_map cuts the flat vector of ``total``
    floats into contiguous shards) re-cut for ``servers`` servers: each per-element tensor
    (momentum, Adam's moments) joined and split at the new shards' bounds; any other state
    (Adam's step) kept where every server agrees, else its largest value (servers apply
    pushes at their own pace). Pure; ValueError when the states cannot be read so."""
    if not isinstance(states, list) or not any(isinstance(st, dict) for st in states):
        raise ValueError("not a parameter server's optimizer state (one per server)")
    states = [st for st in states if st is not None]
    if len(states) == servers:
        return states
    per_param = [st["state"].get(0, {}) for st in states]
    if any(set(p) != set(per_param[0]) for p in per_param):
        raise ValueError("the servers' optimizer states have different entries; resume with "
                         f"--num-ps {len(states)}")
    bounds = [0] + [lo + n for lo, n in partition(total, servers)]
    merged: list = [{} for _ in range(servers)]
    for key in per_param[0]:
        values = [p[key] for p in per_param]
        if all(torch.is_tensor(v) and v.dim() == 1 for v in values) and \
                sum(v.numel() for v in values) == total:
            whole = torch.cat(values)
            for k in range(servers):
                merged[k][key] = whole[bounds[k]:bounds[k + 1]].clone()
        else:
            same = all(torch.equal(torch.as_tensor(v), torch.as_tensor(values[0]))
                       for v in values)
            pick = values[0] if same else max(values, key=lambda v: float(v))
            for k in range(servers):
                merged[k][key] = pick.clone() if torch.is_tensor(pick) else pick
    return [{"state": {0: m} if m else {}, "param_groups": states[0]["param_groups"]}
            for m in merged]
