"""The arguments of DistributedDataParallel (mpidp.ddp.distributed), checked at its construction as
torch's DDP takes them."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..comm import collectives
from ..comm.fingerprint import check_same
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


def agree(g, check: Callable[[], None], settings: Sequence[tuple]) -> None:
    """DistributedDataParallel's construction, before its first collective: ``check()`` (this
    rank's arguments, ``validate`` and the audit's) and the (name, value) ``settings`` that
    decide which collectives each step calls must agree on every rank of group ``g`` — a rank
    whose ``check`` raises still joins the comparison, so every rank raises (its own error
    there, a MismatchError naming it elsewhere) and none waits. Collective."""
    try:
        check()
        failed = None
    except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it
        failed = exc
    check_same(g, settings, "DistributedDataParallel", "its arguments", failed)


def check_audit(every, action) -> None:
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"audit_every must be a whole number of steps >= 0 (0: off), "
                         f"got {every!r}")
    if action not in AUDIT_ACTIONS:
        raise ValueError(f"audit_action must be one of {', '.join(AUDIT_ACTIONS)}, "
                         f"got {action!r}")
