"""All-reduce implementations on host buffers and the ``auto`` choice between them.

Candidates are tried in order and the first enabled one runs (Horovod's operation manager).
Each default threshold cites its measurement in bench/RESULTS.md."""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from . import config, host_kernels
from .dtypes import BF16, F16, OP_MAX, OP_MIN, OP_SUM
from .errors import CommunicationError
from .ring import reduce_scatter_phase, ring_allreduce
from .transports import MPITransport


class Candidate(NamedTuple):
    name: str
    enabled: Callable  # (group, nbytes) -> bool


# Note [Auto choice]: on one node shm wins at every size from 8 B up (bench/RESULTS.md,
# "auto"); across nodes, small messages go straight to MPI (one latency), larger ones to hier,
# from config.hier_min_bytes (64 KiB, where shm+ring overtake MPI_Allreduce on one node).
AUTO_CANDIDATES = (
    Candidate("shm", lambda g, nbytes: g.single_node),
    Candidate("hier", lambda g, nbytes: nbytes >= config.get().hier_min_bytes),
    Candidate("mpi", lambda g, nbytes: True),
)
ALGORITHMS = ("auto", "shm", "ring", "hier", "mpi")


def choose(g, algorithm: str, nbytes: int) -> str:
    """The algorithm to run: ``algorithm`` itself, or for "auto" the first enabled candidate.
    ValueError for an unknown name or one that cannot run on this group."""
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; accepted: {', '.join(ALGORITHMS)}")
    if algorithm == "auto" and g.auto_is_shm:  # the common case, decided once per group
        return "shm"
    if algorithm == "auto":
        algorithm = config.get().algorithm
    if algorithm == "auto":
        return next(c.name for c in AUTO_CANDIDATES if c.enabled(g, nbytes))
    if algorithm == "shm" and not g.single_node:
        raise ValueError(f"algorithm 'shm' needs every rank on one node; this group spans "
                         f"{g.node_count} nodes (use 'hier' or 'auto')")
    return algorithm


# ---- MPI built-ins -----------------------------------------------------------------------

_MPI_OPS: dict = {}


def mpi_op(dtype: int, op: int):
    """The MPI op for (dtype, op): MPI's own for native types, a user op running our kernel
    for float16 and bfloat16 (MPI has no portable type for them)."""
    from mpi4py import MPI
    if dtype not in (F16, BF16):
        return {OP_SUM: MPI.SUM, OP_MIN: MPI.MIN, OP_MAX: MPI.MAX}[op]
    key = (dtype, op)
    if key not in _MPI_OPS:
        def combine(inbuf, inoutbuf, datatype, _dtype=dtype, _op=op):
            host_kernels.reduce_into(inoutbuf, inbuf, _dtype, _op)
        _MPI_OPS[key] = MPI.Op.Create(combine, commute=True)
    return _MPI_OPS[key]


def mpi_buffer(flat: np.ndarray, dtype: int):
    """The buffer spec MPI sees: 16-bit floats travel as uint16 (our op interprets them)."""
    from mpi4py import MPI
    if dtype in (F16, BF16):
        return [flat.view(np.uint16), MPI.UINT16_T]
    return flat


def mpi_allreduce(g, src, dst, dtype, op, divisor):
    from mpi4py import MPI
    send = MPI.IN_PLACE if src is dst else mpi_buffer(src, dtype)
    g.comm.Allreduce(send, mpi_buffer(dst, dtype), op=mpi_op(dtype, op))
    if divisor > 1 and len(dst):
        host_kernels.divide(dst, dtype, divisor)


# ---- ring over MPI point-to-point ----------------------------------------------------------

def _transport(g, comm):
    key = id(comm)
    if key not in g.transports:
        g.transports[key] = MPITransport(comm)
    return g.transports[key]


def _scratch(dst, piece_count):
    n = max(1, min(piece_count, len(dst)))
    return (np.empty(n, dst.dtype), np.empty(n, dst.dtype))


def ring(g, src, dst, dtype, op, divisor, comm=None):
    comm = g.comm if comm is None else comm
    if src is not dst:
        dst[...] = src
    piece = max(1, config.get().ring_piece_bytes // dst.itemsize)
    ring_allreduce(dst, _scratch(dst, piece), _transport(g, comm), host_kernels, dtype, op,
                   divisor, piece)


def ring_reduce_scatter(g, work, dtype, op, chunks):
    """Leaves chunk ``g.rank`` of ``work`` reduced over every rank."""
    piece = max(1, config.get().ring_piece_bytes // work.itemsize)
    reduce_scatter_phase(work, _scratch(work, piece), _transport(g, g.comm), host_kernels,
                         dtype, op, chunks, piece)


# ---- shared memory --------------------------------------------------------------------------

def shm(g, src, dst, dtype, op, divisor, hdr):
    """Runs the shm protocol on this node (handshake and data in one call); returns
    (status, info)."""
    return g.shm().allreduce(hdr, src, dst, dtype, op, divisor)


def hier(g, src, dst, dtype, op, divisor, hdr):
    """Horovod's hierarchical all-reduce: shm within each node, ring among node leaders,
    broadcast within each node. The caller has already checked the headers across nodes."""
    from .shm import SHM_OK
    status, _ = shm(g, src, dst, dtype, op, 1, hdr)
    if status != SHM_OK:  # cannot happen after a successful world-wide handshake
        raise CommunicationError(g.rank, "allreduce (hier)", "node-local handshake disagreed")
    if g.leader_comm is not None:
        ring(g, dst, dst, dtype, op, divisor, comm=g.leader_comm)
    if g.local_size > 1:
        g.node_comm.Bcast(mpi_buffer(dst, dtype), root=0)
