"""The GPU data path: CuPy arrays and torch CUDA tensors go through the same collectives as
host arrays. Our kernels (mpidp/engine/gpu/kernels/*.cu, compiled at run time by CuPy) reduce inside the
ring of mpidp.engine.ring run over NCCL point-to-point; NCCL's own all-reduce is the baseline, and
without NCCL a host-staged path copies to the host and back.

Nothing here imports CuPy until a device array reaches a collective: CPU-only installs never
import it. ``is_device_array`` is the cheap test the host collectives ask first."""
from __future__ import annotations

from typing import Any

import numpy as np


def is_device_array(x: Any) -> bool:
    """True for a CuPy array, a torch CUDA tensor or mpidp's own DeviceArray view of either
    (no import of CuPy or torch is needed)."""
    t = type(x)
    if t is np.ndarray:
        return False
    return getattr(x, "is_cuda", False) is True or t.__module__.startswith(("cupy", _ARRAYS))


_ARRAYS = __name__ + ".arrays"  # DeviceArray's module
