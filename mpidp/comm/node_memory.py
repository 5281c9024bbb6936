"""mpidp.alloc: arrays in memory the other ranks of a node reach without the kernel's copy
(Note [Node heap] in csrc/heap.c) — what MPI_Alloc_mem and ncclMemAlloc are to theirs.

An all-reduce whose buffers every rank of a node took from here is reduced with loads and
stores straight into the peers' memory; any other buffer goes through cross-memory attach, as
before. Both give the same bits; only the speed differs (bench/RESULTS.md, issue 32)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..engine import host_ops


def alloc(shape: Any, dtype: Any = np.float32) -> Any:
    """A zeroed array of ``shape`` and ``dtype`` in the node heap: a numpy array, or a torch
    CPU tensor where ``dtype`` is a torch dtype (``torch.bfloat16`` included). Without the C
    extension (MPIDP_EXTENSION=0), or where the system refuses the memory, an ordinary zeroed
    array, reduced as any other. Its memory is freed when the last array over it goes."""
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"shape must be non-negative ints, got {shape!r}")
    torch_dtype = type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype"
    if torch_dtype:
        import torch
        itemsize = torch.empty((), dtype=dtype).element_size()
    else:
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"dtype must be a numpy or torch dtype, got {dtype!r}") from exc
        itemsize = np_dtype.itemsize
    count = math.prod(dims)
    ext = host_ops.EXTENSION
    block = None
    if ext is not None and count:
        try:
            block = ext.heap_alloc(count * itemsize)  # zeroed: a new file's pages
        except (OSError, MemoryError):  # no memfd here, or 4096 blocks: an ordinary array
            block = None
    if block is None:
        return torch.zeros(dims, dtype=dtype) if torch_dtype else np.zeros(dims, np_dtype)
    if torch_dtype:
        return torch.frombuffer(block, dtype=dtype).view(dims)
    return np.frombuffer(block, np_dtype, count).reshape(dims)
