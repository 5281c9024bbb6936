"""The straggler report of the training loop (Note [Straggler report]): from every rank's
figures of an epoch, the rank that computes clearly slower than the others, if any.

Note [Straggler report]
A synchronous job runs at the pace of its slowest rank; the others wait in the all-reduce. So
at each epoch's end the loop, which already gathers every rank's compute and wait seconds
(the JSON epoch event), compares their compute time per sample (the parameter server's
workers take different numbers of batches; servers, which train on none, are left out). A rank
whose time is at least MARGIN times the median of the others' is named — its rank, host and
how much slower — in one log line and a "straggler" JSON event, when it becomes the straggler
(not again every epoch while it stays one). The window is an epoch: the figures the loop
gathers anyway, so the report costs no collective of its own; a slowdown shorter than an
epoch is diluted in it."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

MARGIN = 1.5  # a clear margin on a machine whose timings wander by 30-50% between launches


def straggler(compute_s: Sequence[float], samples: Sequence[int], hosts: Sequence[str],
              epoch: int, global_step: int) -> Optional[dict]:
    """The "straggler" event of an epoch from every rank's compute seconds and samples
    (``hosts[r]``: rank r's host), None where no rank is MARGIN times slower per sample than
    the median of the others. Pure."""
    ranks = [r for r, n in enumerate(samples) if n > 0]
    if len(ranks) < 2:
        return None
    per_sample = {r: compute_s[r] / samples[r] for r in ranks}
    slow = max(ranks, key=lambda r: per_sample[r])
    others = float(np.median([per_sample[r] for r in ranks if r != slow]))
    if others <= 0 or per_sample[slow] < MARGIN * others:
        return None
    return {"event": "straggler", "epoch": epoch, "global_step": global_step, "rank": slow,
            "host": hosts[slow], "slowdown": per_sample[slow] / others,
            "compute_s_per_sample": per_sample[slow], "others_median_s_per_sample": others}


def describe(event: dict) -> str:
    """The log line of a straggler event."""
    return (f"straggler: rank {event['rank']} on {event['host']} computes "
            f"{event['slowdown']:.1f}x as long per sample as the median of the other ranks "
            f"(epoch {event['epoch']}); in a synchronous job the others wait for it at every "
            "step")
