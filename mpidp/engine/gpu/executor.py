"""The GPU executor: collectives on device arrays (CuPy arrays, torch CUDA tensors) once
the front (mpidp.comm.collectives) has checked them and published their header. It knows nothing
of the host collectives.

All-reduce algorithms on a device: ``ring`` — mpidp.engine.ring over NCCL send/recv with our
kernels; ``nccl`` — ncclAllReduce (the baseline). The front's ``staged`` adapter runs the
host path on a copy made by ``to_host`` and brought back by ``from_host`` (the path without
NCCL, and the other collectives). Every function is collective: every rank calls it."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ... import config
from ..dtypes import BF16
from ..ring import ring_allreduce
from . import device
from .arrays import as_device_array, empty_like, producer_stream, write_back
from .ops import DeviceOps
from .nccl import NCCLTransport


def view(x: Any, what: str = "x"):
    """``x`` as a DeviceArray (TypeError for what is not a supported device array)."""
    return as_device_array(x, what)


def shares_gpu(links) -> bool:
    """True where this node runs more ranks than it has GPUs (ranks bind local_rank % count)."""
    return links.local_size > device.cupy().cuda.runtime.getDeviceCount()


_FACTS = weakref.WeakKeyDictionary()  # a group's links -> its facts with the device's


def facts(links, host_facts):
    """The group's algorithm facts (``host_facts``, mpidp.algorithms.Facts) with what the
    device choices read: NCCL installed, and whether ranks share a GPU (Note [Auto choice on
    GPU] in mpidp/algorithms.py). ``links``: the group's (Note [Handed down] in
    mpidp/engine/links.py)."""
    f = _FACTS.get(links)
    if f is None:
        f = _FACTS[links] = host_facts._replace(nccl=device.nccl_available(),
                                                shares_gpu=shares_gpu(links))
    return f


def transport(links) -> NCCLTransport:
    """The NCCL transport of the group of ``links`` on the current device (made on first
    use: every rank makes it together)."""
    return links.transport(("nccl", device.cupy().cuda.Device().id),
                           lambda: NCCLTransport(links.comm))


def prepare(a, inplace: bool) -> tuple:
    """(result, its flat view, the producer's stream) for all-reducing device array ``a``:
    what can fail on this rank alone (device memory), done before the header goes out."""
    with device.cupy().cuda.Device(a.device):
        out, dst = (a.original, a.flat) if inplace else empty_like(a)
        return out, dst, producer_stream(a)


def allreduce(links, name: str, hdr: tuple, a, prepared: tuple, opc: int, avg: bool) -> None:
    """All-reduces device array ``a`` into ``prepared``'s flat view (``prepare``) with
    algorithm ``name`` (ring or nccl) after the front published ``hdr``."""
    with device.cupy().cuda.Device(a.device):  # this thread may have another current device
        _allreduce_on_device(links, name, hdr, a, prepared, opc, avg)
        if prepared[1] is a.flat:
            write_back(a)


def _allreduce_on_device(links, algo: str, hdr: tuple, a, prepared: tuple, opc: int, avg: bool):
    cp = device.cupy()
    src = a.flat
    _, dst, producer = prepared
    if links.size == 1 and algo == "ring":  # the reduction of one term is the term
        if dst is not src:
            with producer:
                dst[...] = src
        return
    # NCCL runs even alone: one rank is how a single GPU measures it.
    # Note [Watchdog] in mpidp/runtime/watchdog.py: the host waits in the header exchange, in the NCCL
    # communicator's set-up (first call) and while enqueueing; not for the device's work,
    # which the streams order after this returns
    if links.size > 1:
        links.exchange(hdr, "allreduce")
    t = transport(links)
    t.enter(producer)
    if algo == "nccl":
        t.allreduce(src, dst, a.dtype, opc, avg)
    else:
        piece = max(1, config.get().ring_piece_bytes // dst.itemsize)
        with t.compute:  # copies and scratch in the compute stream's order and pool
            if dst is not src:
                dst[...] = src
            n = max(1, min(piece, len(dst)))
            scratch = (cp.empty(n, dst.dtype), cp.empty(n, dst.dtype))
        ring_allreduce(dst, scratch, t, DeviceOps(t.compute), a.dtype, opc,
                       links.size if avg else 1, piece)
    t.leave(producer)


def to_host(a):
    """A C-contiguous host copy of ``a``, after its producer's queued work (a numpy array, or
    a CPU torch tensor for bfloat16, which numpy lacks)."""
    flat = device.cupy().asnumpy(a.flat, stream=producer_stream(a), blocking=True)
    if a.dtype == BF16:
        import torch
        return torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16).reshape(a.shape)
    return flat.reshape(a.shape)


def from_host(result, a, inplace: bool):
    """The host ``result`` on a's device: copied into a's array with ``inplace``, else a new
    array of a's kind."""
    with device.cupy().cuda.Device(a.device):
        return _from_host(result, a, inplace)


def _from_host(result, a, inplace: bool):
    if a.is_torch:
        import torch
        t = torch.from_numpy(result) if isinstance(result, np.ndarray) else result
        if inplace:
            a.original.copy_(t.reshape(a.shape))
            return a.original
        return t.to(a.original.device)
    cp = device.cupy()
    if not isinstance(result, np.ndarray):  # bfloat16 as a torch tensor: its bits
        import torch
        result = result.contiguous().view(torch.int16).numpy().view(np.uint16)
    with producer_stream(a):
        on_device = cp.asarray(result)
        if inplace:
            a.original[...] = on_device.reshape(a.shape)
            return a.original
    return on_device
