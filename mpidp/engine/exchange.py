"""The header exchange (the check every collective starts with: headers built by
mpidp.engine.header), wherever a group's ranks are, and across nodes the small all-reduce that
travels in the same messages (Note [Checked in the message] in
mpidp/engine/doubling.py): on one node through the shared-memory control block; across nodes the
node first (shared memory), then its leaders by recursive doubling over MPI point-to-point,
then the outcome to the node's other ranks. A disagreement found anywhere reaches every rank,
which then exchange their headers once more (MPI_Allgather) to say who called what, and
raise."""
from __future__ import annotations

from typing import Optional

import numpy as np

from . import doubling, header, host_ops
from ..errors import CommunicationError, WaitTimeoutError
from .transports import MPITransport
from .library import loaded_libmpi, mpi


def exchange(links, hdr: tuple, operation: str, local_error: Optional[BaseException] = None,
             data: Optional[np.ndarray] = None, dtype: int = 0, op: int = 0) -> np.ndarray:
    """Checks ``hdr`` against every rank's (``links``: the group's mpidp.engine.links.Links,
    its shared-memory context made where the node has one); returns every
    rank's free word, or raises on every rank (``local_error`` on this one, if given). With
    ``data`` (a flat host array, several nodes) also reduces it in place over every rank, the
    same bits everywhere, in the same messages. Collective."""
    ctx = links.shm
    if links.single_node and ctx is not None:  # the check in shared memory, data over MPI
        ok, info = ctx.exchange(hdr, operation)
        header.check(operation, ok, info, links.rank, local_error)
        if data is not None:
            doubling.run(_transport(links, links.comm),
                         doubling.Record(hdr, links.rank, links.size, data), host_ops,
                         dtype, op)
        return np.asarray(info, np.int64)
    if data is not None and links.c_exchange is not None and \
            data.nbytes <= links.c_exchange.max_bytes and links.wait_timeout_s is None:
        # one C call (Note [Chunks after the record] in csrc/exchange.c); an array it does
        # not take, or any with a timeout to keep (its waits are MPI's), travels in the same
        # records on the Python path
        free = links.c_exchange.exchange(hdr, data, dtype, op)
        if free is None:
            disagreed(links, hdr, operation, local_error)
        return np.asarray(free, np.int64)
    try:
        if ctx is None or links.one_per_node:  # every rank in the doubling (a group-wide
            # fact: with nodes of unequal sizes a node of one rank still goes through its node)
            record = doubling.Record(hdr, links.rank, links.size, data)
            record = doubling.run(_transport(links, links.comm), record, host_ops, dtype, op)
        else:
            record = _across_nodes(links, ctx, hdr, operation, data, dtype, op)
    except WaitTimeoutError as exc:
        if not exc.across:
            raise
        raise _timed_out(links, exc, operation, ctx is not None and not links.one_per_node) \
            from None
    if record.status != doubling.OK:
        disagreed(links, hdr, operation, local_error)
    return record.free


def _timed_out(links, exc: WaitTimeoutError, operation: str, leaders: bool):
    """The transport's timeout (``exc``: the peer that did not answer, a rank of the group, or
    with ``leaders`` a node's index among the leaders) for ``operation``, naming ranks of the
    group: a node's leader stands for its node, any of whose ranks may be the late one."""
    late = exc.late if not leaders else \
        tuple(r for r in range(links.size) if links.node_of[r] in exc.late)
    return WaitTimeoutError(links.rank, operation, exc.timeout_s, late, exc.cause, across=True)


def disagreed(links, hdr: tuple, operation: str, local_error: Optional[BaseException]) -> None:
    """After an exchange found a disagreement (every rank did): the headers once more, in one
    MPI_Allgather, to raise on every rank what each called (``local_error`` on this rank).
    Does not return. Where the C call's MPI failed otherwise than by a longer record (a lost
    process, Note [MPI from C] in csrc/exchange.c), MPI's error is raised instead."""
    code = links.c_exchange.take_error() if links.c_exchange is not None else 0
    if code and mpi().Get_error_class(code) != mpi().ERR_TRUNCATE:
        raise mpi().Exception(code)
    header.share_sites(links.comm, [hdr])  # every rank's call site named on every rank
    header.exchange_mpi(links.comm, hdr, operation, local_error)
    raise CommunicationError(links.rank, operation, "the ranks' headers agreed on a second "
                             "exchange after disagreeing on the first")


def _across_nodes(links, ctx, hdr, operation, data, dtype, op) -> doubling.Record:
    """The node in shared memory, its leader in the doubling, the outcome back to the node.
    The node's sum goes into a copy: a disagreement found across nodes leaves ``data`` as the
    caller passed it."""
    node_sum = None if data is None else np.empty_like(data)
    if data is None:
        ok, info = ctx.exchange(hdr, operation)
    else:
        ok, info = ctx.allreduce(hdr, data, node_sum, dtype, op, 1)
    record = doubling.Record(hdr, links.rank, links.size, node_sum)
    record.out = data  # the result reaches the caller's array only where every rank agreed
    if not ok:
        record.status = doubling.DISAGREE
    elif info is not None:
        record.free[list(links.node_ranks)] = info
    if links.leader_comm is not None:
        record = doubling.run(_transport(links, links.leader_comm), record, host_ops, dtype,
                              op)
    words = np.concatenate(([record.status], record.free)).astype(np.int64)
    carry = ok and data is not None and data.nbytes > 0
    out = np.empty(words.nbytes + (data.nbytes if carry else 0), np.uint8)
    if links.local_rank == 0:
        out[:words.nbytes] = words.view(np.uint8)
        if carry:
            out[words.nbytes:] = data.view(np.uint8).reshape(-1)
    links.node_comm.Bcast(out, root=0)
    got = out[:words.nbytes].view(np.int64)
    record.status, record.free = int(got[0]), got[1:].copy()
    if carry and record.status == doubling.OK:
        data.view(np.uint8).reshape(-1)[...] = out[words.nbytes:]
    return record


CHUNK_BYTES, WINDOW = 32 << 10, 8  # Note [Chunks after the record] in csrc/exchange.c


def c_context(comm, inline_bytes: int, max_bytes: int, board):
    """The all-reduce across nodes in one C call (csrc/exchange.c, one rank per node) of
    arrays up to ``max_bytes`` (their data in the records up to ``inline_bytes``), or None
    where it cannot be made: no C extension, MPI handles neither C ints (MPICH's ABI) nor
    pointers (Open MPI's), MPI errors that abort rather than return, or the MPI library not
    found (Note [MPI from C] in csrc/exchange.c). Not collective."""
    import ctypes
    MPI = mpi()
    ext = host_ops.EXTENSION
    sizes = {MPI._sizeof(t) for t in (MPI.Comm, MPI.Datatype, MPI.Request)}
    size = sizes.pop() if len(sizes) == 1 else 0  # one size for all three, or none
    if ext is None or not hasattr(ext, "CheckedContext") or \
            size not in (4, ctypes.sizeof(ctypes.c_void_p)) or \
            comm.Get_errhandler() != MPI.ERRORS_RETURN:
        return None
    try:
        lib = loaded_libmpi()[0]
        fns = tuple(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value
                    for f in ("MPI_Sendrecv", "MPI_Send", "MPI_Recv", "MPI_Isend",
                              "MPI_Irecv", "MPI_Wait"))
    except (IndexError, OSError, AttributeError):
        return None
    return ext.CheckedContext(fns, size != 4, MPI._handleof(comm), MPI._handleof(MPI.BYTE),
                              comm.Get_rank(), comm.Get_size(), inline_bytes,
                              max(inline_bytes, max_bytes), CHUNK_BYTES, WINDOW, board)


def _transport(links, comm) -> MPITransport:
    transport = links.transport(("mpi", id(comm)), lambda: MPITransport(comm))
    transport.timeout_s = links.wait_timeout_s  # the receives across nodes wait that long
    return transport
