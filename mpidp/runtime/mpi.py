"""MPI's own calls for the layers above this line (Note [MPI below one line] in
mpidp/runtime/__init__.py): the object and byte collectives, point-to-point messages and
requests, communicators and the library's facts, each one MPI call (or a few) on a
communicator handed in. Collectives here run inside their caller's frame (Note [The
collective frame] in mpidp/runtime/frame.py: mpidp.comm.objects and mpidp.comm.blocks give
them theirs); none checks its arguments beyond what MPI does."""
from __future__ import annotations

import functools
import sys
from typing import Any, Optional, Sequence

import numpy as np

from ..engine.library import mpi as _mpi  # Note [MPI imported once]
from ..engine.library import wait_all as _wait_all
from . import recovery


# ---- the library and its communicators ----------------------------------------------------

def world():
    """MPI's COMM_WORLD (starting MPI where nothing has yet)."""
    return _mpi().COMM_WORLD


THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")  # the standard's order


def thread_level() -> str:
    """The thread level MPI was initialised with, by name (THREAD_LEVELS, lowest first: a
    level compares by ``THREAD_LEVELS.index``); "unknown" for a value the library does not
    name. The layers above ask here rather than import mpi4py (Note [MPI below one line] in
    mpidp/runtime/__init__.py)."""
    MPI = _mpi()
    order = (MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED, MPI.THREAD_SERIALIZED, MPI.THREAD_MULTIPLE)
    level = MPI.Query_thread()  # the values are the library's; the standard orders them
    return THREAD_LEVELS[order.index(level)] if level in order else "unknown"


def library() -> dict:
    """{library: the first line of its version, standard: (major, minor), thread: the
    initialised level's index in THREAD_LEVELS (-1: unknown), mpi4py: its version,
    fault_tolerance: "on" in this job, "offered" by the library, or "none"}."""
    MPI = _mpi()
    first = MPI.Get_library_version().strip().splitlines()[0]
    level = thread_level()
    return {"library": " ".join(first.split()), "standard": MPI.Get_version(),
            "thread": THREAD_LEVELS.index(level) if level in THREAD_LEVELS else -1,
            "mpi4py": sys.modules["mpi4py"].__version__,  # loaded with its MPI
            # Note [In-job recovery] in mpidp/runtime/recovery.py
            "fault_tolerance": "on" if recovery.enabled() else
            "offered" if recovery.offered() else "none"}


def tag_limit() -> int:
    """MPI_TAG_UB: the highest tag this library carries."""
    MPI = _mpi()
    return MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)


def rank_size(comm) -> tuple:
    """(this process's rank, the number of ranks) of ``comm``."""
    return comm.Get_rank(), comm.Get_size()


def dup(comm):
    """A duplicate of ``comm`` (collective over it)."""
    return comm.Dup()


def free(comm) -> None:
    """Frees communicator ``comm`` unless it is null or MPI has finalised (collective)."""
    MPI = _mpi()
    if not MPI.Is_finalized() and comm != MPI.COMM_NULL:
        comm.Free()


def node_rank(comm) -> tuple:
    """(rank, size) of this process among the ranks of ``comm`` on its node (a
    COMM_TYPE_SHARED split, freed again). Collective over ``comm``."""
    MPI = _mpi()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


# ---- object collectives (mpidp's own objects, pickled: Note [Object collectives]) ---------

def allgather_objects(comm, mine: Any) -> list:
    return comm.allgather(mine)


def bcast_object(comm, value: Any, root: int) -> Any:
    return comm.bcast(value, root=root)


def gather_objects(comm, mine: Any, root: int) -> Optional[list]:
    return comm.gather(mine, root=root)


def scatter_objects(comm, values: Optional[Sequence], root: int) -> Any:
    return comm.scatter(values, root=root)


def allreduce_int(comm, value: int, op: str = "sum") -> int:
    """The sum (``op`` "sum") or minimum ("min") of every rank's integer ``value``."""
    MPI = _mpi()
    return comm.allreduce(int(value), op={"sum": MPI.SUM, "min": MPI.MIN}[op])


def barrier(comm) -> None:
    comm.Barrier()


def ibarrier(comm):
    """A non-blocking barrier's request (``test``, ``wait_all``)."""
    return comm.Ibarrier()


# ---- byte collectives: numpy arrays (or buffers) moved as they are, never pickled ----------

def bcast_bytes(comm, buf, root: int) -> None:
    comm.Bcast(buf, root=root)


def allgather_bytes(comm, send, recv, in_place: bool = False) -> None:
    """Every rank's ``send`` back to back in rank order into ``recv``; ``in_place``: this
    rank's block of ``recv`` holds its part already (MPI_IN_PLACE)."""
    comm.Allgather(_mpi().IN_PLACE if in_place else send, recv)


def allgatherv_bytes(comm, send, recv, counts, displs) -> None:
    """Rank r's ``send`` (``counts[r]`` bytes) at byte ``displs[r]`` of every rank's
    ``recv``."""
    comm.Allgatherv(send, [recv, counts, displs, _mpi().BYTE])


def gather_bytes(comm, send, recv, root: int) -> None:
    """Every rank's ``send`` (as many bytes each) back to back into root's ``recv`` (None
    elsewhere)."""
    comm.Gather(send, recv, root=root)


def gatherv_bytes(comm, send, recv, counts, root: int) -> None:
    """Rank r's ``send`` (``counts[r]`` bytes) back to back into root's ``recv``; ``recv`` and
    ``counts`` None elsewhere."""
    comm.Gatherv(send, (recv, counts) if recv is not None else None, root=root)


def scatter_bytes(comm, send, recv, root: int) -> None:
    """Block r of root's ``send`` (None elsewhere) into rank r's ``recv``."""
    comm.Scatter(send, recv, root=root)


def alltoall_bytes(comm, send, recv) -> None:
    """Block j of every rank's ``send`` into block r (the sender's rank) of rank j's
    ``recv``; blocks of equal size."""
    comm.Alltoall(send, recv)


def alltoallv_bytes(comm, send, send_counts: list, recv, recv_counts: list) -> None:
    """``send_counts[j]`` bytes of ``send`` (back to back) to rank j, ``recv_counts[j]``
    from rank j into ``recv`` (back to back)."""
    displs = lambda c: [sum(c[:i]) for i in range(len(c))]  # noqa: E731
    comm.Alltoallv([send, (send_counts, displs(send_counts))],
                   [recv, (recv_counts, displs(recv_counts))])


def allreduce_sum_(comm, array: np.ndarray) -> None:
    """MPI_Allreduce of ``array`` in place with MPI_SUM."""
    comm.Allreduce(_mpi().IN_PLACE, array, op=_mpi().SUM)


def allreduce_bound(comm, op, in_place: bool):
    """MPI_Allreduce with MPI op ``op`` bound (``functools.partial``, C-level): called with
    ``(send, recv)``, or with ``(buf,)`` where ``in_place``. For a baseline timed call by
    call (mpidp.bench), which must cost what mpi4py's own call costs: no Python frame here."""
    if in_place:
        return functools.partial(comm.Allreduce, _mpi().IN_PLACE, op=op)
    return functools.partial(comm.Allreduce, op=op)


# ---- point-to-point and requests ---------------------------------------------------------

def send_bytes(comm, buf, dest: int, tag: int) -> None:
    comm.Send([buf, _mpi().BYTE], dest=dest, tag=tag)


def isend_bytes(comm, buf, dest: int, tag: int):
    """A send's request (``wait``, ``test``)."""
    return comm.Isend([buf, _mpi().BYTE], dest=dest, tag=tag)


def irecv_bytes(comm, buf, source: Optional[int], tag: int):
    """A receive's request (``wait``, ``test``, ``cancel``); ``source`` None: from any
    source (an ``AnySourceReceive``)."""
    if source is None:
        return AnySourceReceive(comm, [buf, _mpi().BYTE], tag)
    return comm.Irecv([buf, _mpi().BYTE], source=source, tag=tag)


# Note [A receive from any source]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# MPICH 5.0.2 over UCX (the mpich wheel's default netmod) loses the message that a posted
# MPI_ANY_SOURCE receive should match when another thread drives MPI's progress meanwhile, as
# mpidp's scheduler and watchdog threads do. Across two emulated nodes, with mpi4py alone (a
# second thread testing a receive of its own), 5 runs of 6 hung within 750 round trips; with
# the netmod ofi, or without the second thread, none of 5 runs of 3000; with MPICH's shared
# memory off, 2 of 2 still hung; with a matched probe, none of 13 runs of 3000 to 5000.
# Through the backend (body_dist.py's 300 round trips on 2 x 1 nodes): 3 runs of 3 hung
# before, none of 7 since; CI hung there once, in the 2 x 1 launch of 2026-12-01.
# So mpidp posts no receive from any source: it matches the message with MPI_Improbe (at each
# test; MPI_Mprobe when waited for) and receives exactly that message (MPI_Imrecv), which no
# other receive can take once matched. One difference from a posted receive, where receives
# of one tag are mixed: a receive from any source matches when it is tested or waited for,
# so a receive from a named rank posted after it can take a message that MPI would have
# given the earlier receive from any source, and of two receives from any source the one
# tested or waited for first takes the first message.

class AnySourceReceive:
    """A receive from any source of ``tag`` on ``comm`` into ``spec`` (a buffer as mpi4py
    takes it), through a matched probe (Note [A receive from any source]); it answers MPI's
    request calls — ``Test``, ``Wait`` (each with an optional status) and ``Cancel`` — so
    that the helpers here and the watchdog take it as a request."""

    def __init__(self, comm, spec, tag: int):
        self.comm, self.spec, self.tag = comm, spec, tag
        self.request = None  # the matched message's receive
        self.cancelled = False
        self._match(block=False)

    def _match(self, block: bool):
        if self.request is None and not self.cancelled:
            MPI = _mpi()
            message = (self.comm.Mprobe if block else self.comm.Improbe)(MPI.ANY_SOURCE,
                                                                          self.tag)
            if message is not None:
                self.request = message.Irecv(self.spec)
        return self.request

    def Test(self, status=None) -> bool:
        if self.cancelled and self.request is None:
            return True
        request = self._match(block=False)
        return request is not None and bool(request.Test(status))

    def Wait(self, status=None) -> None:
        if self.cancelled and self.request is None:
            return
        self._match(block=True).Wait(status)

    def Cancel(self) -> None:
        """As MPI cancels a posted receive: one that a message already here matches receives
        it (``Wait`` completes it), one that none matches ends having received nothing."""
        if self._match(block=False) is None:
            self.cancelled = True


def recv_bytes(comm, buf, source: int, tag: int) -> None:
    comm.Recv([buf, _mpi().BYTE], source=source, tag=tag)


def sendrecv_bytes(comm, send, dest: int, recv, source: int, tag: int) -> None:
    comm.Sendrecv(send, dest, tag, recv, source, tag)


def iprobe(comm, source: Optional[int], tag: int) -> Optional[tuple]:
    """(source, bytes) of a message waiting with ``tag`` from ``source`` (None: any), else
    None."""
    MPI = _mpi()
    status = MPI.Status()
    if not comm.Iprobe(source=MPI.ANY_SOURCE if source is None else source, tag=tag,
                       status=status):
        return None
    return status.Get_source(), status.Get_count(MPI.BYTE)


def wait(request) -> tuple:
    """Completes ``request``: (source, bytes) of what it received (a send's are MPI's
    values for none)."""
    MPI = _mpi()
    status = MPI.Status()
    request.Wait(status)
    return status.Get_source(), status.Get_count(MPI.BYTE)


def test(request) -> bool:
    """True once ``request`` is complete."""
    return bool(request.Test())


def test_status(request) -> Optional[tuple]:
    """(source, bytes) of what ``request`` received once it is complete (a send's are MPI's
    values for none), else None; as ``wait``, without waiting."""
    MPI = _mpi()
    status = MPI.Status()
    if not request.Test(status):
        return None
    return status.Get_source(), status.Get_count(MPI.BYTE)


def test_all(requests: list) -> bool:
    """True once every request of ``requests`` is complete."""
    return bool(_mpi().Request.Testall(requests))


def wait_all(requests: list) -> None:
    """Every request of ``requests`` completed; a failed one raises its own error."""
    _wait_all(requests)


def cancel(requests: list) -> None:
    """Cancels the requests not yet complete and completes the cancellation."""
    MPI = _mpi()
    for r in requests:
        if r != MPI.REQUEST_NULL:
            r.Cancel()
            r.Wait()
