"""The arguments of DistributedDataParallel (mpidp.ddp.distributed), checked at its construction as
torch's DDP takes them."""
from __future__ import annotations

import numpy as np
import torch

from ..comm import collectives
from ..errors import MismatchError
from ..config import AUDIT_ACTIONS


def validate(module, device_ids, output_device, dim, process_group, bucket_cap_mb, algorithm):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    home = {p.device for p in module.parameters()}
    if len(home) > 1:
        raise ValueError(f"the module's parameters are on several devices ({sorted(map(str, home))});"
                         " one rank's replica lives on one device")
    for what, value in (("device_ids", device_ids), ("output_device", output_device)):
        devices = value if isinstance(value, (list, tuple)) else [value]
        if what == "device_ids" and len(devices) > 1:
            raise ValueError(f"device_ids={value!r}: one device per rank (as torch's DDP for a "
                             "single-device module)")
        for d in devices:
            if d is None:
                continue
            dev = torch.device(f"cuda:{d}" if isinstance(d, int) else d)
            here = next(iter(home), None)
            if here is not None and (dev.type != here.type or
                                     dev.index is not None and dev.index != here.index):
                raise ValueError(f"{what}={value!r}: the module's parameters are on "
                                 f"{next(iter(home))}; move the module there first "
                                 "(module.to(device)), as with torch's DDP")
    if dim != 0:
        raise ValueError(f"dim={dim!r}: only dim=0 is supported (as torch's default)")
    if process_group is not None:
        raise ValueError("process_group: pass the communicator to mpidp.init(comm) instead")
    if bucket_cap_mb is not None and (not isinstance(bucket_cap_mb, (int, float))
                                      or isinstance(bucket_cap_mb, bool)
                                      or not bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    collectives.check_algorithm(algorithm, any(p.is_cuda for p in module.parameters()))


def _check_audit(every, action) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"audit_every must be a whole number of steps >= 0 (0: off), "
                         f"got {every!r}")
    if action not in AUDIT_ACTIONS:
        raise ValueError(f"audit_action must be one of {', '.join(AUDIT_ACTIONS)}, "
                         f"got {action!r}")


def agree_audit(g, every, action) -> tuple:
    """(every, action) of the replica audit (Note [Replica audit] in mpidp/ddp/audit.py): checked
    (``every`` a whole number of steps >= 0, 0: off; ``action`` raise or warn) and the same on
    every rank of group ``g``, or an error on every rank (this rank's ValueError where its own
    are bad, a MismatchError elsewhere). Collective."""
    try:
        _check_audit(every, action)
        mine = np.array([[every, AUDIT_ACTIONS.index(action)]], np.int64)
        error = None
    except ValueError as exc:
        mine, error = np.array([[-1, -1]], np.int64), exc
    table = collectives.allgather(mine) if g.size > 1 else mine
    if error is not None:
        raise error
    if (table != table[0]).any():
        raise MismatchError(
            f"rank {g.rank}: DistributedDataParallel: the replica audit's settings differ "
            "between ranks: " + ", ".join(
                f"rank {r}: " + ("bad" if e < 0 else f"audit_every={e}, audit_action="
                                 f"{AUDIT_ACTIONS[a]}") for r, (e, a) in enumerate(table))
            + " (every rank raises this error)")
    return every, action
