"""The host executor: collectives on flat numpy buffers once the front (mpidp.comm.collectives)
has checked them and published their header — the all-reduce algorithms of mpidp.algorithms'
table (shm, ring, hier, MPI's own) and MPI's broadcast, reduce, allgather and reduce-scatter.
Each function here exchanges the header with the other ranks (or lets the shared-memory call
carry it with the data) and then moves the data; every rank of the group calls it."""
from __future__ import annotations

import numpy as np

from .. import config
from . import header, host_ops
from .dtypes import BF16, F16, FLOATING, OP_MAX, OP_MIN, OP_SUM
from ..errors import CommunicationError
from .ring import reduce_scatter_phase, ring_allreduce
from .transports import MPITransport
from .library import mpi


# ---- MPI built-ins -----------------------------------------------------------------------

_MPI_OPS: dict = {}


def mpi_op(dtype: int, op: int):
    """The MPI op for (dtype, op): MPI's own for integers, a user op running our kernel for
    floats — MPI has no portable type for float16 and bfloat16, and our kernel propagates NaN
    through min and max as IEEE and torch do, where MPI's own need not."""
    MPI = mpi()
    if dtype not in (F16, BF16) and (op == OP_SUM or dtype not in FLOATING):
        return {OP_SUM: MPI.SUM, OP_MIN: MPI.MIN, OP_MAX: MPI.MAX}[op]
    key = (dtype, op)
    if key not in _MPI_OPS:
        def combine(inbuf, inoutbuf, datatype, _dtype=dtype, _op=op):
            host_ops.reduce_into(inoutbuf, inbuf, _dtype, _op)
        _MPI_OPS[key] = MPI.Op.Create(combine, commute=True)
    return _MPI_OPS[key]


def mpi_buffer(flat: np.ndarray, dtype: int):
    """The buffer spec MPI sees: 16-bit floats travel as uint16 (our op interprets them)."""
    MPI = mpi()
    if dtype in (F16, BF16):
        return [flat.view(np.uint16), MPI.UINT16_T]
    return flat


def _divide(flat, dtype: int, divisor: int) -> None:
    if divisor > 1 and len(flat):
        host_ops.divide(flat, dtype, divisor)


# ---- all-reduce ------------------------------------------------------------------------------

def allreduce(links, name: str, hdr: tuple, src, dst, dtype: int, op: int, divisor: int) -> None:
    """All-reduces ``src`` into ``dst`` (may be ``src``) with algorithm ``name`` after the
    front published ``hdr``; raises on every rank when the headers disagree."""
    if name == "shm":
        ok, info = links.shm.allreduce(hdr, src, dst, dtype, op, divisor)
        if not ok:
            raise header.mismatch_error("allreduce", info, links.rank)
        return
    if name == "doubling":  # the check and the data in the same messages
        if src is not dst:
            dst[...] = src
        links.exchange(hdr, "allreduce", None, dst, dtype, op)
        _divide(dst, dtype, divisor)
        return
    links.exchange(hdr, "allreduce")
    if name == "mpi":
        MPI = mpi()
        send = MPI.IN_PLACE if src is dst else mpi_buffer(src, dtype)
        links.comm.Allreduce(send, mpi_buffer(dst, dtype), op=mpi_op(dtype, op))
        _divide(dst, dtype, divisor)
    elif name == "ring":
        ring(links, links.comm, src, dst, dtype, op, divisor)
    else:
        hier(links, hdr, src, dst, dtype, op, divisor)


def allreduce_segments(links, hdr: tuple, flats: list, dtype: int, op: int, divisor: int) -> None:
    """The shared-memory all-reduce of ``flats`` in place, back to back as one buffer, without
    packing them (Note [Zero-copy buckets] in mpidp/comm/buckets.py)."""
    ok, info = links.shm.allreduce(hdr, flats, None, dtype, op, divisor)
    if not ok:
        raise header.mismatch_error("allreduce", info, links.rank)


def _scratch(dst, piece_count):
    n = max(1, min(piece_count, len(dst)))
    return (np.empty(n, dst.dtype), np.empty(n, dst.dtype))


def _transport(links, comm) -> MPITransport:
    return links.transport(("mpi", id(comm)), lambda: MPITransport(comm))


def ring(links, comm, src, dst, dtype, op, divisor) -> None:
    """mpidp.engine.ring's all-reduce over MPI point-to-point on ``comm``."""
    if src is not dst:
        dst[...] = src
    piece = max(1, config.get().ring_piece_bytes // dst.itemsize)
    ring_allreduce(dst, _scratch(dst, piece), _transport(links, comm), host_ops, dtype, op,
                   divisor, piece)


def hier(links, hdr, src, dst, dtype, op, divisor) -> None:
    """Horovod's hierarchical all-reduce: shm within each node, ring among node leaders,
    broadcast within each node. The headers were checked across nodes already."""
    ok, _ = links.shm.allreduce(hdr, src, dst, dtype, op, 1)
    if not ok:  # cannot happen after a successful world-wide handshake
        raise CommunicationError(links.rank, "allreduce (hier)", "node-local handshake disagreed")
    if links.leader_comm is not None:
        ring(links, links.leader_comm, dst, dst, dtype, op, divisor)
    if links.local_size > 1:
        links.node_comm.Bcast(mpi_buffer(dst, dtype), root=0)


# ---- the other collectives -------------------------------------------------------------------

def broadcast(links, hdr: tuple, flat, root: int) -> None:
    links.exchange(hdr, "broadcast")
    links.comm.Bcast(flat.view(np.uint8), root=root)


def reduce(links, hdr: tuple, flat, dtype: int, op: int, divisor: int, root: int) -> None:
    """MPI_Reduce in place at ``root``; the roots travel in the header's free word."""
    roots = links.exchange(hdr, "reduce")
    if len(set(int(r) for r in roots)) > 1:
        raise header.MismatchError(
            f"rank {links.rank}: reduce called with different roots: "
            + ", ".join(f"rank {i} root={int(r)}" for i, r in enumerate(roots)))
    MPI = mpi()
    buf, mop = mpi_buffer(flat, dtype), mpi_op(dtype, op)
    if links.rank == root:
        links.comm.Reduce(MPI.IN_PLACE, buf, op=mop, root=root)
        _divide(flat, dtype, divisor)
    else:
        links.comm.Reduce(buf, None, op=mop, root=root)


def allgather(links, src, out_flat, rows: list, row: int) -> None:
    """MPI_Allgatherv of every rank's ``rows`` rows of ``row`` elements (after allgather_rows)."""
    counts = [r * row * src.itemsize for r in rows]
    displs = [sum(counts[:i]) for i in range(len(counts))]
    links.comm.Allgatherv(src.view(np.uint8), [out_flat.view(np.uint8), (counts, displs)])


def allgather_rows(links, hdr: tuple) -> list:
    """Every rank's first dimension (the header's free word), the headers checked."""
    return [int(r) for r in links.exchange(hdr, "allgather")]


def reduce_scatter(links, name: str, hdr: tuple, src, out_flat, dtype: int, op: int, divisor: int,
                   chunks: tuple) -> None:
    links.exchange(hdr, "reduce_scatter")
    if name == "ring":
        work = src.copy()
        piece = max(1, config.get().ring_piece_bytes // work.itemsize)
        reduce_scatter_phase(work, _scratch(work, piece), _transport(links, links.comm), host_ops,
                             dtype, op, chunks, piece)
        offset, count = chunks[links.rank]
        out_flat[...] = work[offset:offset + count]
    else:
        links.comm.Reduce_scatter(mpi_buffer(src, dtype), mpi_buffer(out_flat, dtype),
                              [c for _, c in chunks], op=mpi_op(dtype, op))
    _divide(out_flat, dtype, divisor)
