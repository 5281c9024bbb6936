"""Overwriting every rank's tensors with one rank's: parameters and buffers in fused byte
buckets (any dtype), and an optimizer's whole state — ``broadcast_parameters``,
``broadcast_optimizer_state`` (Horovod's names) and ``broadcast_tensors_``, which
DistributedDataParallel, CentralStorage and the parameter server use at start-up — and the
other way, every rank's own tensors gathered on one as raw bytes (``gather_bytes``).

Every function here is collective: every rank calls it with tensors of the same shapes and
dtypes, in the same order."""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import numpy as np

from . import collectives
from ..engine import host_ops
from .. import runtime
from ..engine.dtypes import I64, flat_host_array
from ..engine.header import BROADCAST
from .fusion import assign_buckets, tensor_list, writable_view
from ..engine.gpu import is_device_array
from ..runtime import mpi
from ..runtime.frame import collective
from . import objects


def _byte_view(t: Any) -> np.ndarray:
    """Raw bytes of a contiguous CPU tensor or numpy array of any dtype."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    import torch
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def broadcast_tensors_(tensors: Sequence[Any], root: int = 0,
                       bucket_cap_bytes: int = 64 << 20) -> None:
    """Overwrites every tensor with root's, through fused byte buckets (any dtype). Every rank
    passes tensors of the same shapes and dtypes in the same order."""
    items = list(tensors)
    contiguous, copied = zip(*[_contiguous(t) for t in items]) if items else ((), ())
    sizes = [_byte_view(t).nbytes for t in contiguous]
    groups = assign_buckets(sizes, [0] * len(sizes), bucket_cap_bytes)
    me = runtime.rank()
    for b in groups:
        total = sum(sizes[i] for i in b)
        words = np.zeros((total + 7) // 8, np.int64)  # bytes travel as 64-bit words
        raw = words.view(np.uint8)
        if me == root:
            host_ops.pack(raw, [_byte_view(contiguous[i]) for i in b])
        collectives.broadcast_(flat_host_array(words, I64), root)
        if me != root:
            _unpack_bytes(raw, [contiguous[i] for i in b])
    for original, c, was_copied in zip(items, contiguous, copied):
        if not was_copied or me == root:
            continue
        if isinstance(original, np.ndarray):
            np.copyto(original, c)
        elif is_device_array(original) and not hasattr(original, "copy_"):  # CuPy
            original[...] = sys.modules["cupy"].asarray(c)
        else:
            writable_view(original).copy_(c)


def gather_bytes(tensors: Sequence[Any], what: str, root: int = 0) -> Optional[np.ndarray]:
    """Every rank's ``tensors`` (any dtype, host or device), as raw bytes back to back: a
    (ranks, bytes) uint8 array on ``root``, None elsewhere. They travel as buffers through
    MPI_Gather, never pickled: checkpoints keep each rank's own state this way (PowerSGD's
    errors, local SGD's models between meetings). Every rank passes as many bytes; ``what``
    names the collective for the watchdog."""
    g = runtime.group()
    parts = [_byte_view(_contiguous(t)[0]) for t in tensors]
    mine = np.concatenate(parts) if parts else np.empty(0, np.uint8)
    every = np.empty((g.size, mine.size), np.uint8) if g.rank == root else None
    with collective(g, what):
        mpi.gather_bytes(g.comm, mine, every, root)
    return every


def _contiguous(t: Any) -> tuple:
    """(``t`` itself, detached, False) where contiguous, else (a contiguous copy, True). A
    device array travels as a host copy: parameters are broadcast once at start-up, and the
    buffers broadcast per forward are small (running statistics)."""
    if is_device_array(t):
        if hasattr(t, "detach"):
            return t.detach().cpu().contiguous(), True
        return sys.modules["cupy"].asnumpy(t), True
    if isinstance(t, np.ndarray):
        return (t, False) if t.flags.c_contiguous else (np.ascontiguousarray(t), True)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor):
        raise TypeError(f"each tensor must be a numpy.ndarray or a CPU torch.Tensor, got "
                        f"{type(t).__module__}.{type(t).__qualname__}")
    t = t.detach()
    if t.device.type != "cpu":
        raise TypeError(f"tensor on device {t.device}; host collectives take CPU tensors")
    return (t, False) if t.is_contiguous() else (t.contiguous(), True)


def _unpack_bytes(raw: np.ndarray, tensors: Sequence[Any]) -> None:
    """The inverse of packing byte views (any item size, so not the typed C unpack)."""
    offset = 0
    for t in tensors:
        v = _byte_view(t)
        v[...] = raw[offset:offset + v.nbytes]
        offset += v.nbytes


def broadcast_parameters(params: Any, root: int = 0) -> None:
    """Overwrites every rank's parameters with root's, in place (Horovod's name): ``params``
    is a ``state_dict()``, ``named_parameters()`` or a list of tensors. Every rank calls it."""
    collectives.check_root(root, runtime.size())
    broadcast_tensors_(tensor_list(params, "params"), root)


def broadcast_optimizer_state(optimizer: Any, root: int = 0) -> None:
    """Gives every rank root's optimizer state (moments, step counts, hyper-parameters such
    as the learning rate), loaded with ``optimizer.load_state_dict``. The structure travels
    pickled, the tensors in fused buckets. Every rank calls it, with the same parameters."""
    import torch
    g = runtime.group()
    try:
        collectives.check_root(root, g.size)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
    except Exception as exc:
        collectives.refuse(g, BROADCAST, exc)
        raise
    # a checked step first: MPI's own broadcast of the structure (objects.bcast) checks
    # nothing, so a rank that refused, joined (hvd.join) or called another collective is
    # named here, on every rank, rather than waited for
    collectives.broadcast_(np.zeros(1, np.int64), root)
    state = broadcast_state_dict(optimizer.state_dict() if runtime.rank() == root else None,
                                 root)
    if runtime.rank() != root:
        optimizer.load_state_dict(state)


def broadcast_state_dict(state: Any, root: int = 0) -> dict:
    """Root's optimizer ``state`` (``{"state": ..., "param_groups": ...}``; None elsewhere) on
    every rank: the structure pickled, the tensors in fused buckets. Collective."""
    import torch
    collectives.check_root(root, runtime.size())
    g = runtime.group()
    tensors: list = []
    structure = None
    if g.rank == root:

        def strip(value):
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach().cpu().contiguous())
                return ("mpidp-tensor", len(tensors) - 1, tuple(value.shape), str(value.dtype))
            if isinstance(value, dict):
                return {k: strip(v) for k, v in value.items()}
            return value
        structure = {"state": {k: strip(v) for k, v in state["state"].items()},
                     "param_groups": state["param_groups"]}
    if g.size == 1:
        return state
    structure = objects.bcast(g, structure, "broadcast_optimizer_state: the state's structure",
                              root)
    if g.rank != root:

        def fill(value):
            if isinstance(value, tuple) and len(value) == 4 and value[0] == "mpidp-tensor":
                t = torch.empty(value[2], dtype=getattr(torch, value[3].split(".")[-1]))
                tensors.append(t)
                return t
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            return value
        structure = {"state": {k: fill(v) for k, v in structure["state"].items()},
                     "param_groups": structure["param_groups"]}
    broadcast_tensors_(tensors, root)
    return state if g.rank == root else structure
