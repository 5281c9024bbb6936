"""Where a training run computes (``--device``) and in what precision (``--amp``): Note
[Training device]."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..engine.gpu.device import training_device

# Note [Training device]
# --device auto trains on CUDA when every rank sees a GPU and no two ranks are bound to the
# same one (mpidp.init binds a rank to GPU local_rank % the GPUs it sees; ranks compare the
# bound GPUs' UUIDs, so per-task binding such as srun --gpus-per-task=1, where each rank sees
# one GPU of its own, counts as one GPU per rank); otherwise on the CPU, and the log says
# why. --device cuda insists: a rank without a GPU is a one-line
# error naming it, and ranks sharing a GPU are allowed with a note (they contend for it).
# On CUDA the model, every batch and the DDP buckets live on the GPU; mirrored, localsgd and
# diloco train there. central and ps keep their parameters in host memory (central's reduce
# and broadcast, the parameter server's MPI windows), so they train on the CPU: auto picks it
# with a note, --device cuda is refused naming the strategy.
# --amp bf16 runs forward and loss under torch.autocast in bfloat16 (no scaler: bfloat16 has
# float32's range), for every strategy. --amp fp16 autocasts in float16 and scales the loss
# with torch.amp.GradScaler; a scaler's skip-or-step decision must be the same on every rank,
# which holds where every rank steps on the same averaged gradients: mirrored without --zero
# (ZeRO's owners see different gradient halves). Its state (scale, growth tracker) is saved
# in checkpoints ("amp_scaler") and restored on resume. autocast's CPU kernels make both
# modes runnable, and tested, on the CPU; the speed is the GPU's to give.
DEVICES = ("auto", "cpu", "cuda")
AMPS = ("off", "bf16", "fp16")
ON_CUDA = ("mirrored", "localsgd", "diloco")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def decide(setting: str, strategy: str, gpus: list) -> tuple:
    """('cpu' or 'cuda', why) for ``--device setting`` under ``strategy`` on ranks whose
    ``gpus[r]`` is mpidp.engine.gpu.device.torch_gpu's (count, identity). Pure; ValueError for a
    choice that cannot be had, naming the rank or the strategy."""
    return training_device(setting, [n for n, _ in gpus], [i for _, i in gpus],
                           None if strategy in ON_CUDA else strategy, ON_CUDA)


def autocast(device: torch.device, amp: str):
    """The context forward and loss run in for ``--amp amp``."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[amp])


def scaler_for(device: torch.device, amp: str) -> Optional[torch.amp.GradScaler]:
    """torch's gradient scaler for ``--amp fp16``; None otherwise."""
    return torch.amp.GradScaler(device.type) if amp == "fp16" else None


def to_device(batch: tuple, device: torch.device) -> tuple:
    """A batch's tensors on ``device`` (as they are on the CPU)."""
    if device.type == "cpu":
        return batch
    return tuple(t.to(device, non_blocking=True) for t in batch)
