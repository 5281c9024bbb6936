"""The shared-memory algorithm of ranks on one node: the control window, the choice between
cross-memory attach and staging segments, and the calls of the C protocol
(Note [Shared-memory protocol] in csrc/shm.c)."""
from __future__ import annotations

import functools
import os
from typing import Optional

from . import config
from .errors import CommunicationError
from .dtypes import ITEMSIZE
from .host_kernels import extension
from .ring import partition

SHM_OK, SHM_MISMATCH, SHM_TIMEOUT, SHM_PEER_ERROR = range(4)
PEERS_CMA, PEERS_WINDOW = range(2)
DATA_NONE, DATA_INLINE, DATA_SLICED = range(3)


class ShmContext:
    """The control block and (in window mode) staging segments of one node's ranks.

    Made collectively by every rank of ``node_comm``; every call below is collective too."""

    def __init__(self, node_comm):
        from mpi4py import MPI
        self._ext = extension()
        self.comm = node_comm
        self.rank, self.size = node_comm.Get_rank(), node_comm.Get_size()
        if self.size > self._ext.SHM_MAX_RANKS:
            raise ValueError(f"{self.size} ranks on one node; shm supports at most "
                             f"{self._ext.SHM_MAX_RANKS}")
        nbytes = self.size * self._ext.SHM_SLOT_BYTES if self.rank == 0 else 0
        self._ctrl_win = MPI.Win.Allocate_shared(nbytes, 1, comm=node_comm)
        mem, _ = self._ctrl_win.Shared_query(0)
        self.ctrl_addr = MPI.memory(mem).address
        if self.rank == 0:
            MPI.memory(mem)[:] = b"\0" * len(mem)
        node_comm.Barrier()
        self.seq = 0
        # a backstop behind the watchdog, which reports first (Note [Watchdog] in watchdog.py)
        self.timeout_s = 2 * config.get().timeout_s + 10
        self.chunk_bytes = config.get().shm_chunk_bytes
        self.inline_bytes = min(config.get().shm_inline_bytes, self._ext.SHM_INLINE_BYTES)
        self.peers = self._choose_peers(config.get().shm_peers)
        self._seg_win = None
        self._seg_capacity = 0
        self.segments: Optional[tuple] = None
        self._shm_run = functools.partial(self._ext.shm_run, self.ctrl_addr, self.size, self.rank)

    def _choose_peers(self, wanted: str) -> int:
        """Cross-memory attach where every rank can read its neighbour, else staging."""
        if wanted == "window":
            return PEERS_WINDOW
        record = (os.getpid(), self.ctrl_addr)
        everyone = self.comm.allgather(record)
        right = everyone[(self.rank + 1) % self.size]
        err = self._ext.cma_probe(right[0], right[1], 8) if self.size > 1 else 0
        errors = self.comm.allgather(err)
        if all(e == 0 for e in errors):
            return PEERS_CMA
        if wanted == "cma":
            bad = [r for r, e in enumerate(errors) if e]
            raise CommunicationError(self.rank, "shm set-up",
                                     f"MPIDP_SHM_PEERS=cma but process_vm_readv failed on local "
                                     f"ranks {bad} (errno {errors[bad[0]]}): ptrace is restricted")
        return PEERS_WINDOW

    @property
    def mode_name(self) -> str:
        return "cma" if self.peers == PEERS_CMA else "window"

    def ensure_segments(self, nbytes: int) -> None:
        """Window mode: grows every rank's staging segment to ``nbytes`` (collective; callers
        pass the same size on every rank)."""
        from mpi4py import MPI
        if nbytes <= self._seg_capacity:
            return
        capacity = max(1 << 20, 1 << (nbytes - 1).bit_length())
        if self._seg_win is not None:
            self._seg_win.Free()
        self._seg_win = MPI.Win.Allocate_shared(capacity, 1, comm=self.comm,
                                                info=MPI.Info.Create(dict(alloc_shared_noncontig="true")))
        self.segments = tuple(MPI.memory(self._seg_win.Shared_query(q)[0]).address
                              for q in range(self.size))
        self._seg_capacity = capacity

    def run(self, header: tuple, data: int, src, dst, dtype: int, op: int, divisor: int,
            slice_lo: int = 0, slice_hi: int = 0, operation: str = "allreduce"):
        """One protocol call; returns the C status and info (see mpidp._ext.shm_run)."""
        self.seq += 1
        status, info = self._shm_run(self.seq, header, data, src, dst, dtype, op, divisor,
                                     slice_lo, slice_hi, self.chunk_bytes, self.peers,
                                     self.segments, self.timeout_s)
        if status <= SHM_MISMATCH:
            return status, info
        if status == SHM_TIMEOUT:
            raise CommunicationError(
                self.rank, operation, f"timed out after {self.timeout_s:g} s waiting for local "
                f"ranks {info} (2 x MPIDP_TIMEOUT_S + 10 s, and the watchdog did not end the "
                "job); they never reached this collective")
        if status == SHM_PEER_ERROR:
            failed, peer, errno = info
            raise CommunicationError(self.rank, operation,
                                     f"local rank {failed} could not reach local rank {peer}: "
                                     f"{os.strerror(errno)}")
        return status, info

    def exchange(self, header: tuple, operation: str) -> tuple:
        """Handshake only: returns every rank's header if they disagree (status MISMATCH),
        else every rank's free word."""
        return self.run(header, DATA_NONE, None, None, 2, 0, 1, operation=operation)

    def allreduce(self, header: tuple, src, dst, dtype: int, op: int, divisor: int,
                  segments: Optional[list] = None) -> tuple:
        """Reduces the flat buffer ``src`` of every local rank into ``dst`` (may be ``src``):
        inline up to ``inline_bytes``, else this rank reduces its ``partition`` slice for all.
        With ``segments`` (src and dst None) the data is those contiguous buffers back to back,
        reduced in place without packing (only above ``inline_bytes``, at most
        ``max_segments``; Note [Zero-copy buckets] in mpidp/fusion.py).
        Returns (status, info) so the caller can report a mismatch found in the same call."""
        nbytes = src.nbytes if segments is None else sum(s.nbytes for s in segments)
        if nbytes <= self.inline_bytes:
            assert segments is None, "segmented calls are sliced calls"
            return self.run(header, DATA_INLINE, src, dst, dtype, op, divisor)
        if self.peers == PEERS_WINDOW:
            status, info = self.exchange(header, "allreduce")
            if status != SHM_OK:
                return status, info
            self.ensure_segments(nbytes)
        lo, count = partition(nbytes // ITEMSIZE[dtype], self.size)[self.rank]
        if segments is not None:
            src = list(segments)
        return self.run(header, DATA_SLICED, src, dst, dtype, op, divisor, lo, lo + count)

    @property
    def max_segments(self) -> int:
        return self._ext.SHM_MAX_SEGMENTS

    def free(self) -> None:
        for w in (self._seg_win, self._ctrl_win):
            if w is not None:
                w.Free()
        self._seg_win = self._ctrl_win = None

