"""The replica audit of a data-parallel model (Note [Replica audit]): every rank's parameters
and buffers checksummed and compared, the first that differs named with the ranks.

Note [Replica audit]
Data parallelism rests on every rank holding the same model; a rank whose parameters drift
(a bit flip, a non-deterministic kernel, an optimizer that saw other gradients, a missed
broadcast) trains on silently. DistributedDataParallel(audit_every=K) (or MPIDP_AUDIT_EVERY)
checksums every parameter (not the buffers: a BatchNorm's running statistics are each rank's
own between broadcasts), by its bytes (CRC-32), at the end of every K-th
synchronised backward — before the optimizer's step, so the model compared is the one all
ranks just computed gradients with — and all-gathers the checksums (one int64 per tensor per
rank). A difference names the first tensor that differs and which ranks hold which version, and
raises on every rank (MPIDP_AUDIT_ACTION=raise, the default) or warns (warn). The settings are
compared across ranks at construction. Cost: a pass over the parameters' bytes per audit,
measured in bench/RESULTS.md."""
from __future__ import annotations

import zlib
from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import MpidpError


class ReplicaDivergenceError(MpidpError):
    """The ranks' replicas of a model differ; raised on every rank."""


def checksums(tensors: Sequence) -> np.ndarray:
    """The CRC-32 of every tensor's bytes (CPU or GPU), as int64."""
    out = np.empty(len(tensors), np.int64)
    for k, t in enumerate(tensors):
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        raw = np.from_dlpack(data.contiguous().reshape(-1).view(torch.uint8))
        out[k] = zlib.crc32(raw)
    return out


def divergence(table: np.ndarray, names: Sequence[str], step: int) -> Optional[str]:
    """The message for checksums ``table`` (rank, tensor) that differ between ranks, None
    where every rank's agree. Pure."""
    same = (table == table[0]).all(axis=0)
    if same.all():
        return None
    k = int(np.argmin(same))
    groups: dict = {}
    for rank, value in enumerate(table[:, k]):
        groups.setdefault(int(value), []).append(rank)
    versions = sorted(groups.values(), key=lambda ranks: (-len(ranks), ranks))
    held = "; ".join(("rank " if len(r) == 1 else "ranks ") + ", ".join(map(str, r))
                     + (" holds" if len(r) == 1 else " hold") + f" version {i + 1}"
                     for i, r in enumerate(versions))
    others = int((~same).sum()) - 1
    return (f"mpidp: replica audit at synchronised step {step}: the ranks' models differ; "
            f"first differing tensor {names[k]!r}: {held}"
            + (f" ({others} more tensor{' differs' if others == 1 else 's differ'})"
               if others else ""))
