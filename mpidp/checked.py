"""The check every collective starts with, wherever its ranks are, and across nodes the small
all-reduce that travels in the same messages (Note [Checked in the message] in
mpidp/doubling.py): on one node through the shared-memory control block; across nodes the
node first (shared memory), then its leaders by recursive doubling over MPI point-to-point,
then the outcome to the node's other ranks. A disagreement found anywhere reaches every rank,
which then exchange their headers once more (MPI_Allgather) to say who called what, and
raise."""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import doubling, handshake, host_kernels
from .errors import CommunicationError
from .transports import MPITransport

_WORD = np.dtype(np.int64).itemsize


def exchange(res, hdr: tuple, operation: str, local_error: Optional[BaseException] = None,
             data: Optional[np.ndarray] = None, dtype: int = 0, op: int = 0) -> np.ndarray:
    """Checks ``hdr`` against every rank's (``res``: the group's Resources); returns every
    rank's free word, or raises on every rank (``local_error`` on this one, if given). With
    ``data`` (a flat host array, several nodes) also reduces it in place over every rank, the
    same bits everywhere, in the same messages. Collective."""
    topo, ctx = res.topo, res.shm()
    if topo.single_node and ctx is not None:  # the check in shared memory, data over MPI
        ok, info = ctx.exchange(hdr, operation)
        handshake.check(operation, ok, info, topo.rank, local_error)
        if data is not None:
            doubling.run(_transport(res, topo.comm),
                         doubling.Record(hdr, topo.rank, topo.size, data), host_kernels,
                         dtype, op)
        return np.asarray(info, np.int64)
    if ctx is None or topo.local_size == 1:  # every rank in the doubling
        record = doubling.Record(hdr, topo.rank, topo.size, data)
        record = doubling.run(_transport(res, topo.comm), record, host_kernels, dtype, op)
    else:
        record = _across_nodes(res, topo, ctx, hdr, operation, data, dtype, op)
    if record.status != doubling.OK:
        handshake.exchange_mpi(topo.comm, hdr, operation, local_error)  # raises everywhere
        raise CommunicationError(topo.rank, operation, "the ranks' headers agreed on a second "
                                 "exchange after disagreeing on the first")
    return record.free


def _across_nodes(res, topo, ctx, hdr, operation, data, dtype, op) -> doubling.Record:
    """The node in shared memory, its leader in the doubling, the outcome back to the node."""
    if data is None:
        ok, info = ctx.exchange(hdr, operation)
    else:
        ok, info = ctx.allreduce(hdr, data, data, dtype, op, 1)
    record = doubling.Record(hdr, topo.rank, topo.size, data)
    if not ok:
        record.status = doubling.DISAGREE
    elif info is not None:
        record.free[list(topo.node_ranks)] = info
    if topo.leader_comm is not None:
        record = doubling.run(_transport(res, topo.leader_comm), record, host_kernels, dtype,
                              op)
    words = np.concatenate(([record.status], record.free)).astype(np.int64)
    carry = ok and data is not None and data.nbytes > 0
    out = np.empty(words.nbytes + (data.nbytes if carry else 0), np.uint8)
    if topo.local_rank == 0:
        out[:words.nbytes] = words.view(np.uint8)
        if carry:
            out[words.nbytes:] = data.view(np.uint8).reshape(-1)
    topo.node_comm.Bcast(out, root=0)
    got = out[:words.nbytes].view(np.int64)
    record.status, record.free = int(got[0]), got[1:].copy()
    if carry and record.status == doubling.OK:
        data.view(np.uint8).reshape(-1)[...] = out[words.nbytes:]
    return record


def _transport(res, comm) -> MPITransport:
    return res.transport(("mpi", id(comm)), lambda: MPITransport(comm))
