"""CuPy and NCCL as optional libraries (an ImportError naming the pip install where one is
missing), and the binding of each rank to its GPU."""
from __future__ import annotations

import socket
import sys
import threading

from ...errors import BackendUnavailableError

# Note [GPU wheels]: ``pip install 'mpidp[gpu]'`` installs cupy-cuda12x and nvidia-nccl-cu12
# (CUDA 12 builds run on every driver from 525 on, CUDA 13 ones need 580+);
# ``mpidp[gpu-cuda13]`` installs cupy-cuda13x and nvidia-nccl-cu13 instead.
INSTALL_HINT = ("pip install 'mpidp[gpu]' (CuPy and NCCL for CUDA 12; 'mpidp[gpu-cuda13]' for "
                "CUDA 13)")

_bound: dict = {}
_lock = threading.Lock()


def cupy():
    """The cupy module; BackendUnavailableError saying what to install where it is missing."""
    try:
        import cupy as cp
    except ImportError as exc:
        raise BackendUnavailableError(f"mpidp: GPU arrays need CuPy ({exc}); {INSTALL_HINT}") \
            from None
    return cp


def nccl():
    """cupy.cuda.nccl; BackendUnavailableError where CuPy cannot load the NCCL library."""
    cupy()
    try:
        from cupy.cuda import nccl as module
    except ImportError as exc:
        module, reason = None, str(exc)
    else:
        reason = "CuPy could not load libnccl"
    if module is None or not getattr(module, "available", False):
        raise BackendUnavailableError(f"mpidp: NCCL is not available ({reason}); "
                                      f"{INSTALL_HINT}, or pip install nvidia-nccl-cu12")
    return module


def nccl_available() -> bool:
    try:
        nccl()
    except ImportError:
        return False
    return True


def device_for(local_rank: int, device_count: int) -> int:
    """The GPU a rank binds to: ``local_rank % device_count`` (one rank per GPU when the
    launcher starts as many ranks per node as there are GPUs)."""
    if device_count < 1:
        raise ValueError(f"no GPU visible to local rank {local_rank}")
    return local_rank % device_count


def bind(local_rank: int) -> int:
    """Makes GPU ``local_rank % device_count`` current for CuPy and (if it is imported) torch;
    once per process. Returns the device index."""
    with _lock:
        if "device" in _bound:
            return _bound["device"]
        cp = cupy()
        device = device_for(local_rank, cp.cuda.runtime.getDeviceCount())
        cp.cuda.Device(device).use()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.set_device(device)
        _bound["device"] = device
        return device


def visible_devices() -> int:
    """GPUs this process can use, asked of torch or CuPy only where the user imported them."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.device_count()
    if "cupy" in sys.modules:
        try:
            return sys.modules["cupy"].cuda.runtime.getDeviceCount()
        except Exception:  # CuPy without a driver or device
            return 0
    return 0


def bind_if_visible(local_rank: int) -> None:
    """At ``mpidp.init``: binds before any CUDA work where the user's process uses CUDA
    through torch or CuPy and a GPU is visible; does nothing (and imports nothing) else."""
    if visible_devices() == 0:
        return
    try:
        bind(local_rank)
    except Exception:  # no CuPy, or one built for another CUDA: bind torch alone
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.set_device(device_for(local_rank, torch.cuda.device_count()))


def torch_gpu(local_rank: int) -> tuple:
    """(GPUs torch sees here, the identity of the one a rank of this ``local_rank`` is bound
    to: its UUID, unique across nodes; None without CUDA). Imports torch (deferred for cost:
    only the training tool and the doctor ask)."""
    import torch
    if not torch.cuda.is_available():
        return 0, None
    count = torch.cuda.device_count()
    index = device_for(local_rank, count)
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return count, str(uuid) if uuid is not None else f"{socket.gethostname()}/{index}"


def training_device(setting: str, gpus: list, ids: list, host_strategy=None,
                    cuda_strategies: tuple = ()) -> tuple:
    """('cpu' or 'cuda', why) for a training run's ``--device setting`` (auto, cpu, cuda:
    Note [Training device] in mpidp/train/devices.py) on ranks that see ``gpus[r]`` GPUs and
    are bound to the GPU of identity ``ids[r]`` (``torch_gpu``: two ranks with one identity
    share a GPU); ``host_strategy``: the name of a training mode that keeps its parameters in
    host memory (None: the mode can train on CUDA, as ``cuda_strategies`` can). Pure;
    ValueError for a choice that cannot be had."""
    if setting == "cpu":
        return "cpu", "--device cpu"
    without = [r for r, n in enumerate(gpus) if n == 0]
    shared = [r for r, i in enumerate(ids) if i is not None and ids.count(i) > 1]
    if setting == "cuda":
        if host_strategy is not None:
            raise ValueError(f"--device cuda: --strategy {host_strategy} keeps its parameters "
                             f"in host memory and trains on the CPU; use --device cpu (CUDA "
                             f"training: {', '.join(cuda_strategies)})")
        if without:
            raise ValueError(f"--device cuda: rank {without[0]} sees no GPU "
                             f"({len(without)} of {len(gpus)} ranks see none)")
        why = "--device cuda"
        if shared:
            why += f"; ranks {shared[0]} and {shared[1]} share a GPU (more ranks than GPUs)"
        return "cuda", why
    if without:
        return "cpu", ("auto: no GPU visible" if len(without) == len(gpus) else
                       f"auto: rank {without[0]} sees no GPU")
    if shared:
        return "cpu", f"auto: ranks {shared[0]} and {shared[1]} would share a GPU"
    if host_strategy is not None:
        return "cpu", f"auto: --strategy {host_strategy} trains on the CPU"
    return "cuda", "auto: a GPU for every rank"
