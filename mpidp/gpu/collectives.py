"""Collectives on device arrays (CuPy arrays, torch CUDA tensors), reached through the public
functions of mpidp.collectives, which hand any device array here.

All-reduce algorithms on a device (``algorithm=``): ``ring`` — mpidp.ring over NCCL
send/recv with our kernels; ``nccl`` — ncclAllReduce (the baseline); ``staged`` — device →
host, the host all-reduce ("auto"), host → device; ``auto`` — ring where NCCL is available,
staged otherwise (Note [Auto choice on GPU]). The other collectives are staged through the
host. Every function is collective: every rank calls it, all with device arrays or all with
host arrays (the header exchange names a rank that differs)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import collectives as host  # the host collectives (they hand device arrays to us)
from .. import config, handshake, runtime
from ..dtypes import BF16
from ..handshake import ALGORITHM_CODES, ALLREDUCE
from ..ring import ring_allreduce
from . import device
from .arrays import as_device_array, empty_like, producer_stream, write_back
from .kernels import DeviceOps
from .nccl import NCCLTransport

ALGORITHMS = ("auto", "ring", "nccl", "staged")

# Note [Auto choice on GPU]: the product's default is our ring (the collective we own and
# measure against NCCL's, bench/RESULTS.md "GPU"); NCCL's all-reduce stays one word away.
# NCCL needs a GPU of its own per rank ("Duplicate GPU detected" otherwise): where a node has
# more ranks than GPUs, and without NCCL, the only path is through the host. The test is
# local (ranks on a node agree); nodes that disagree meet in the header exchange, which
# names the difference instead of hanging.


def shares_gpu(g) -> bool:
    """True where this node runs more ranks than it has GPUs (ranks bind local_rank % count)."""
    return g.local_size > device.cupy().cuda.runtime.getDeviceCount()


def choose(g, algorithm: str) -> str:
    """The device algorithm to run; ValueError for a name that is not one, or NCCL's where
    ranks share a GPU."""
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r} for device arrays; accepted: "
                         f"{', '.join(ALGORITHMS)}")
    if algorithm == "auto":
        return "ring" if device.nccl_available() and not shares_gpu(g) else "staged"
    if algorithm in ("ring", "nccl"):
        device.nccl()  # BackendUnavailableError with the install line
        if shares_gpu(g):
            raise ValueError(f"algorithm {algorithm!r} runs over NCCL, which needs one GPU per "
                             f"rank; this node has {g.local_size} ranks on fewer GPUs (use "
                             "'staged' or 'auto', or one rank per GPU)")
    return algorithm


def transport(g) -> NCCLTransport:
    """The NCCL transport of group ``g`` on the current device (made on first use: every rank
    makes it together)."""
    key = ("nccl", device.cupy().cuda.Device().id)
    if key not in g.transports:
        g.transports[key] = NCCLTransport(g.comm)
    return g.transports[key]


def allreduce(x: Any, op: str, algorithm: str, inplace: bool):
    """mpidp.allreduce / allreduce_ for a device array."""
    g = runtime.group()
    try:
        a = as_device_array(x)
        opc, avg = host._op_codes(op, a.dtype)
        algo = choose(g, algorithm)
    except (TypeError, ValueError, ImportError) as exc:  # ImportError: CuPy or NCCL missing
        host.refuse(g, ALLREDUCE, exc)
        raise
    if algo == "staged":  # the host all-reduce posts itself on the watchdog's board
        return staged(x, inplace, ALLREDUCE, lambda h: host.allreduce_(h, op))
    with device.cupy().cuda.Device(a.device):  # this thread may have another current device
        return _allreduce_on_device(g, a, opc, avg, algo, inplace)


def _allreduce_on_device(g, a, opc: int, avg: bool, algo: str, inplace: bool):
    cp = device.cupy()
    src = a.flat
    out, dst = (a.original, src) if inplace else empty_like(a)
    producer = producer_stream(a)
    if g.size == 1 and algo == "ring":  # the reduction of one term is the term
        if dst is not src:
            with producer:
                dst[...] = src
    else:  # NCCL runs even alone: one rank is how a single GPU measures it
        # Note [Watchdog] in mpidp/watchdog.py: the host waits in the header exchange, in
        # the NCCL communicator's set-up (first call) and while enqueueing; not for the
        # device's work, which the streams order after this returns
        b = g.board
        code = ALGORITHM_CODES["ring on GPU" if algo == "ring" else "nccl"]
        hdr = b.publish(handshake.header(ALLREDUCE, code, opc + 4 * avg, a.dtype, len(src),
                                         a.shape))
        try:
            if g.size > 1:
                handshake.exchange(g, hdr, "allreduce")
            t = transport(g)
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
                               g.size if avg else 1, piece)
            t.leave(producer)
        finally:
            b.done = b.seq
    if inplace:
        write_back(a)
    return out


def staged(x: Any, inplace: bool, kind: int, host_call):
    """Runs ``host_call`` on a host copy of ``x`` and returns its result on x's device (in
    place into ``x`` with ``inplace``): the path without NCCL, and the one of the collectives
    NCCL does not give us. ``host_call`` returns the host result (for in-place calls, its
    argument). ``kind``: the handshake's collective code, for reporting a bad ``x``."""
    g = runtime.group()
    try:
        a = as_device_array(x)
    except (TypeError, ImportError) as exc:
        host.refuse(g, kind, exc)
        raise
    with device.cupy().cuda.Device(a.device):
        return _from_host(host_call(_to_host(a)), a, inplace)


def _to_host(a):
    """A C-contiguous host copy of ``a``, after its producer's queued work (a numpy array, or
    a CPU torch tensor for bfloat16, which numpy lacks)."""
    flat = device.cupy().asnumpy(a.flat, stream=producer_stream(a), blocking=True)
    if a.dtype == BF16:
        import torch
        return torch.from_numpy(flat.view(np.int16)).view(torch.bfloat16).reshape(a.shape)
    return flat.reshape(a.shape)


def _from_host(result, a, inplace: bool):
    """The host ``result`` on a's device: copied into a's array with ``inplace``, else a new
    array of a's kind."""
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
