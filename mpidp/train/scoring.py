"""What a run is scored by: held-out accuracy over every rank's share of the test set, and a
digest of the parameters (equal runs give equal digests)."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..comm import collectives
from ..runtime import timeline
from ..workloads.data import ShardSampler, batches

EVAL_BATCH = 512


def parameters_sha256(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer, bit for bit (equal runs give equal digests)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@timeline.traced("evaluate")
def evaluate(module: torch.nn.Module, test, g) -> float:
    """Held-out accuracy: every rank scores its share, the counts are summed. Every rank
    calls it."""
    sampler = ShardSampler(len(test), g.rank, g.size, shuffle=False, pad=False)
    device = next(module.parameters()).device
    counts = np.zeros(2, np.int64)
    was_training = module.training
    module.eval()
    with torch.no_grad():
        for x, y in batches(test, sampler.indices(0), EVAL_BATCH):
            counts += (int((module(x.to(device)).argmax(1).cpu() == y).sum()), len(y))
    module.train(was_training)
    if g.size > 1:
        collectives.allreduce_(counts, "sum")
    return float(counts[0] / max(counts[1], 1))
