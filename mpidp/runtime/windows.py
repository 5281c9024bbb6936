"""MPI one-sided windows, owned: allocated with ``Win.Allocate`` by the owner (measured 3–7×
faster than ``Win.Create`` with MPICH), locked in a ``with``, freed explicitly; and typed
regions inside them that peers read with ``Get``, add to with ``Accumulate`` and count with
``Fetch_and_op`` — the parameter server's (mpidp.modes.ps) — a node's shared memory (its
node-local shards), and the doctor's probe of a node's shared window. Below the line of Note [MPI below one line] (mpidp/runtime/__init__.py).
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from .mpi import _mpi

_ALIGN = 8  # every region starts on an 8-byte boundary


class Region:
    """``count`` elements of ``dtype`` (numpy) at byte ``offset`` of every owner's window."""

    __slots__ = ("offset", "count", "dtype")

    def __init__(self, offset: int, count: int, dtype: Any):
        self.offset, self.count, self.dtype = offset, count, np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize

    def mpi_type(self):
        MPI = _mpi()
        return {np.dtype(np.float32): MPI.FLOAT, np.dtype(np.float64): MPI.DOUBLE,
                np.dtype(np.int64): MPI.INT64_T}[self.dtype]


def layout(*regions: tuple) -> tuple:
    """Regions laid out back to back, each 8-byte aligned, from (count, dtype) pairs: returns
    (Region, ..., total bytes)."""
    out, offset = [], 0
    for count, dtype in regions:
        r = Region(offset, count, dtype)
        out.append(r)
        offset += -(-r.nbytes // _ALIGN) * _ALIGN
    return (*out, offset)


class Window:
    """A window over ``comm`` in which this process exposes ``nbytes`` (0 on ranks that only
    access others'). Collective to create and to ``free``."""

    def __init__(self, comm: Any, nbytes: int):
        MPI = _mpi()
        self._MPI = MPI
        self.comm = comm
        self.win = MPI.Win.Allocate(nbytes, 1, comm=comm)
        self.memory = np.frombuffer(self.win.tomemory(), np.uint8) if nbytes else \
            np.zeros(0, np.uint8)
        self.memory[...] = 0

    def local(self, region: Region) -> np.ndarray:
        """This owner's ``region`` as a numpy array (touch it only inside ``locked(own rank,
        exclusive=True)``)."""
        return self.memory[region.offset:region.offset + region.nbytes].view(region.dtype)

    @contextlib.contextmanager
    def locked(self, rank: int, exclusive: bool = False):
        """A passive-target access epoch on ``rank``'s memory: operations issued inside are
        complete when it ends. An exclusive epoch excludes every other epoch on that rank."""
        MPI = self._MPI
        self.win.Lock(rank, MPI.LOCK_EXCLUSIVE if exclusive else MPI.LOCK_SHARED)
        try:
            yield self
        finally:
            self.win.Unlock(rank)

    def get(self, out: np.ndarray, rank: int, region: Region, start: int = 0) -> None:
        """Reads ``len(out)`` elements of ``rank``'s ``region`` from element ``start``."""
        self.win.Get(out, rank, (region.offset + start * region.dtype.itemsize, len(out),
                                 region.mpi_type()))

    def get_atomic(self, out: np.ndarray, rank: int, region: Region) -> None:
        """Reads ``rank``'s whole ``region`` atomically per element with respect to
        concurrent accumulates (``Get_accumulate`` with ``NO_OP``)."""
        self.win.Get_accumulate(np.zeros_like(out), out, rank,
                                (region.offset, len(out), region.mpi_type()), op=self._MPI.NO_OP)

    def accumulate(self, values: np.ndarray, rank: int, region: Region, start: int = 0) -> None:
        """Adds ``values`` element-wise (atomically per element) into ``rank``'s ``region``."""
        self.win.Accumulate(values, rank, (region.offset + start * region.dtype.itemsize,
                                           len(values), region.mpi_type()), op=self._MPI.SUM)

    def fetch_add(self, rank: int, region: Region, index: int, value: int) -> int:
        """Atomically adds ``value`` to int64 element ``index`` of ``rank``'s ``region`` and
        returns what it held before (0 adds nothing: an atomic read). Inside ``locked``,
        complete at once."""
        MPI = self._MPI
        add = np.array([value], np.int64)
        old = np.zeros(1, np.int64)
        self.win.Fetch_and_op(add, old, rank, region.offset + index * 8, MPI.SUM)
        self.win.Flush(rank)
        return int(old[0])

    def free(self) -> None:
        """Collective: every rank of ``comm`` frees the window together."""
        if self.win is not None:
            self.memory = np.zeros(0, np.uint8)
            self.win.Free()
            self.win = None


class SharedWindow:
    """Memory that every rank of node communicator ``node`` maps (``Win.Allocate_shared``):
    this rank exposes ``nbytes`` (0 on ranks that only reach others'), and ``memory_of(r)``
    is local rank r's part as a numpy byte array, loaded and stored directly (the callers
    synchronise with atomics: Note [Node-local shards] in mpidp/modes/ps_shared.py).
    Collective over ``node`` to create and to ``free``; zeroed."""

    def __init__(self, node: Any, nbytes: int):
        self.win = _mpi().Win.Allocate_shared(nbytes, 1, comm=node)
        self._memory = {}
        if nbytes:
            self.memory_of(node.Get_rank())[...] = 0
        node.Barrier()  # zeroed before anyone reads

    def memory_of(self, local_rank: int) -> np.ndarray:
        if local_rank not in self._memory:
            buf, _ = self.win.Shared_query(local_rank)
            self._memory[local_rank] = np.frombuffer(buf, np.uint8)
        return self._memory[local_rank]

    def free(self) -> None:
        """Collective over the node."""
        if self.win is not None:
            self._memory.clear()
            self.win.Free()
            self.win = None


def shared_slots_sum(node, slot: int, value: int, slots: int) -> int:
    """Each rank of node communicator ``node`` writes ``value`` into its ``slot`` of an
    ``MPI.Win.Allocate_shared`` window, and reads every slot back (``slots`` of them): their
    sum, as loads and stores through the shared memory see it. Collective over ``node``."""
    win = _mpi().Win.Allocate_shared(8, 8, comm=node)
    try:
        win.Lock_all()
        np.frombuffer(win.Shared_query(slot)[0], np.int64)[0] = value
        win.Sync()
        node.Barrier()
        win.Sync()
        got = sum(int(np.frombuffer(win.Shared_query(q)[0], np.int64)[0])
                  for q in range(slots))
        win.Unlock_all()
    finally:
        win.Free()
    return got
