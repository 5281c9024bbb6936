"""mpidp.alloc: arrays in memory the other ranks of a node reach without the kernel's copy
(Note [Node heap] in csrc/heap.c) — what MPI_Alloc_mem and ncclMemAlloc are to theirs.

An all-reduce whose buffers every rank of a node took from here is reduced with loads and
stores straight into the peers' memory; any other buffer goes through cross-memory attach, as
before. Both give the same bits; only the speed differs (bench/RESULTS.md, issue 32)."""
from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from .. import config
from ..engine import host_ops
from ..engine.shm import yama_scope


def alloc(shape: Any, dtype: Any = np.float32) -> Any:
    """A zeroed array of ``shape`` and ``dtype`` in node memory: a numpy array, or a torch CPU
    tensor where ``dtype`` is a torch dtype (``torch.bfloat16`` included). This rank's, not
    collective. An ordinary zeroed array instead where node memory is not offered: without
    the C extension, where peers stage through a window (MPIDP_SHM_PEERS=window), where Yama
    restricts ptrace (Note [Node heap]), or where the system refuses the memory or the
    descriptors. Its memory is freed when the last array over it goes (a peer's mapping may
    hold the pages a while longer)."""
    dims = _dims(shape)
    torch_dtype = type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"
    if torch_dtype:
        import torch
        itemsize = torch.empty((), dtype=dtype).element_size()
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"dtype must be a numpy or torch dtype, got {dtype!r}") from exc
        if np_dtype.kind not in "biufc":
            raise TypeError(f"dtype must be a numeric dtype, got {np_dtype}")
        itemsize = np_dtype.itemsize
    count = math.prod(dims)
    try:  # zeroed: a new file's pages
        block = host_ops.EXTENSION.heap_alloc(count * itemsize) if count and offered() else None
    except (OSError, MemoryError):  # no memfd here, or too many blocks
        block = None
    if block is None:
        return torch.zeros(dims, dtype=dtype) if torch_dtype else np.zeros(dims, np_dtype)
    if torch_dtype:
        return torch.frombuffer(block, dtype=dtype).view(dims)
    return np.frombuffer(block, np_dtype, count).reshape(dims)


def _dims(shape: Any) -> tuple:
    """``shape`` (an int, or a tuple or list of them) as a tuple of non-negative ints."""
    items = shape if isinstance(shape, (tuple, list)) else (shape,)
    if all(hasattr(type(d), "__index__") and not isinstance(d, bool) for d in items):
        dims = tuple(operator.index(d) for d in items)
        if all(d >= 0 for d in dims):
            return dims
    raise ValueError(f"shape must be non-negative ints, got {shape!r}")


def offered() -> bool:
    """Whether node memory is handed out here (Note [Node heap]: who may map it)."""
    return (host_ops.EXTENSION is not None and config.get().shm_peers != "window" and
            yama_scope() == 0)
