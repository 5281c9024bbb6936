"""What collectives use on top of a group's topology: the watchdog's board (and thread), the
engine's links (the node's shared-memory context, the transports, the header exchange:
Note [Handed down] in mpidp/engine/links.py), and the facts the algorithm choices read. Made
by ``mpidp.init`` for its group."""
from __future__ import annotations

import contextlib

import sys
import warnings
from typing import Callable, Optional

from ..engine import exchange, header, host_ops
from ..engine.links import Links
from .. import config
from . import timeline
from ..algorithms import HOST, Facts, choose
from ..engine.shm import ShmContext
from .topology import Topology
from .frame import collective
from .watchdog import Board, Watchdog
from ..engine.library import mpi


# Note [Stopping the users first]
# A thread of mpidp's own may be inside a collective when the group is freed: the group's
# communication thread waits in the shared-memory protocol for a bucket when Ctrl-C ends the
# main thread, whose exit then runs mpidp.shutdown (atexit). Freeing the windows under it
# would make it read unmapped memory (a segfault). So such a thread registers a stop with the
# resources (add_user), and free, before it frees anything, closes the shared-memory context
# (every wait in it ends at its next poll, Note [Interrupting a wait] in csrc/shm.c, and no
# call enters again), then stops and joins each registered thread. One that does not end
# (waiting in an MPI call) leaves everything unfreed: a leak at exit, never a segfault.


class Resources:
    """Owned by one group (``topo``); every method that communicates is collective over it."""

    def __init__(self, topo: Topology, cfg: config.Config):
        self.topo = topo  # the group itself (mpidp.runtime.Group), as collectives see it
        self.board = Board(cfg.debug)  # Note [Watchdog] in mpidp/runtime/watchdog.py
        ext = host_ops.EXTENSION
        self.facts = Facts(
            size=topo.size, single_node=topo.single_node, shm=ext is not None,
            hier_min_bytes=cfg.hier_min_bytes, default=cfg.algorithm,
            doubling_max_bytes=cfg.doubling_max_bytes,
            one_per_node=topo.node_count == topo.size,
            inline_bytes=min(cfg.shm_inline_bytes, ext.SHM_INLINE_BYTES) if ext else 0,
            max_segments=ext.SHM_MAX_SEGMENTS if ext else 0)
        self._shm: Optional[ShmContext] = None
        self.wait_timeout_s: Optional[float] = None  # set_wait_timeout
        self.links = Links(  # Note [Handed down] in mpidp/engine/links.py
            topo.rank, topo.size, topo.comm, topo.node_comm, topo.leader_comm, topo.local_rank,
            topo.local_size, topo.node_ranks, topo.node_of, topo.single_node,
            topo.node_count == topo.size)
        self._users: list = []  # Note [Stopping the users first]
        # the group's communication thread (mpidp.comm.scheduler.of: Note [One communication
        # thread per group] in mpidp/comm/scheduler.py), one of the users
        self.scheduler = None
        self._closed = False  # stop_users ran: the one-call paths stay off
        self._stuck = False
        self.watchdog: Optional[Watchdog] = None
        # Note [Small all-reduce in one call] in csrc/small.c: the C call that is the whole
        # in-place all-reduce of a small numpy array, once the node's context exists, where
        # auto means shm and nothing else must see every call (debug headers; the timeline
        # while it records: ``record``)
        self.fast_allreduce: Optional[Callable] = None
        self.fast_max_bytes = 0  # the largest array it takes
        self._fast_ok = (topo.size > 1 and choose(HOST, "auto", self.facts, 8).name == "shm"
                         and not cfg.debug)
        self.c_exchange = None  # across nodes, one rank per node: csrc/exchange.c's context
        if topo.size > 1 and self.facts.one_per_node and not cfg.debug \
                and choose(HOST, "auto", self.facts, 8).name == "doubling":
            self._make_c_exchange(cfg)

    def _make_c_exchange(self, cfg: config.Config) -> None:
        """The C call across nodes, where every rank could make it (agreed: one collective
        step), taking arrays of any size in chunks between two nodes (Note [Chunks after the
        record] in csrc/exchange.c; Note [Auto choice] in mpidp/algorithms.py)."""
        MPI = mpi()
        topo = self.topo
        chunks = topo.size == 2
        inline = cfg.doubling_max_bytes - 1
        try:  # whatever happens on this rank, the others must hear of it: no raise here
            ctx = exchange.c_context(topo.comm, inline, sys.maxsize if chunks else inline,
                                    self.board)
        except Exception:  # noqa: BLE001 - any failure means: the Python path
            ctx = None
        if not topo.comm.allreduce(int(ctx is not None), op=MPI.MIN):
            return  # a rank without it: the Python path everywhere, alike
        self.c_exchange = self.links.c_exchange = ctx
        self.fast_allreduce = self._one_call()
        self.fast_max_bytes = sys.maxsize if chunks else inline
        self.facts = self.facts._replace(checked_chunks=chunks)

    def start_watchdog(self, timeout_s: float) -> None:
        """Starts the watching thread (collective; only where there is more than one rank)."""
        if self.topo.size > 1:
            self.watchdog = Watchdog(self.topo, timeout_s)
            self.watchdog.waits_bounded_s = self.wait_timeout_s

    def shm(self) -> Optional[ShmContext]:
        """The node's shared-memory context (None without the C extension): collective on
        first use, watched as a collective of its own when none is under way."""
        if self._shm is None and self.facts.shm:
            if self.board.seq == self.board.done:
                with collective(self.topo, "shared-memory set-up", check=False):
                    self._shm = ShmContext(self.topo.node_comm, self.facts.inline_bytes,
                                           self.topo.node_ranks)
            else:
                self._shm = ShmContext(self.topo.node_comm, self.facts.inline_bytes,
                                       self.topo.node_ranks)
            self.links.shm = self._shm
            if self.wait_timeout_s is not None:
                self._shm.set_timeout(self.wait_timeout_s)
            if self._fast_ok:
                self._shm.c.set_board(self.board)
                self.fast_max_bytes = self.facts.inline_bytes
                self.fast_allreduce = self._one_call()
        return self._shm

    def _one_call(self) -> Optional[Callable]:
        """The one-call path (Note [Small all-reduce in one call] in csrc/small.c) where
        nothing holds it off: the C exchange across nodes (not under a wait timeout), else
        the node's context once made. None while the timeline records (it would see no
        call of it: Note [Timeline cost] in mpidp/runtime/timeline.py) and once the group is
        closing."""
        if self._closed or timeline.ON:
            return None
        if self.c_exchange is not None:
            return self.c_exchange.allreduce_array if self.wait_timeout_s is None else None
        return self._shm.c.allreduce_array if self._fast_ok and self._shm is not None else None

    def record(self) -> None:
        """The timeline has started or stopped recording (timeline.ON): the one-call path is
        off while it records and back when it stops (Note [A timeline started while running]
        in mpidp/runtime/timeline.py). Called outside any collective of the group; this rank
        only."""
        self.fast_allreduce = self._one_call()

    def set_wait_timeout(self, timeout_s: Optional[float]) -> None:
        """The collectives entering from now on wait at most ``timeout_s`` (None: the
        backstop, 2 x MPIDP_TIMEOUT_S + 10 s, on the node; the watchdog across nodes) for the
        other ranks to reach them, then raise WaitTimeoutError (a torch group's timeout: Note
        [A group's timeout] in mpidp/backend/group.py): on the node in the shared-memory
        protocol, across nodes in the header exchange's receives (which then take the Python
        path, whose MPI waits are polled, rather than the one C call). This rank only."""
        self.wait_timeout_s = self.links.wait_timeout_s = timeout_s
        if self.watchdog is not None:
            self.watchdog.waits_bounded_s = timeout_s
        if self._shm is not None:
            self._shm.set_timeout(timeout_s)
        if self.c_exchange is not None:
            self.fast_allreduce = self._one_call()

    def fast_disagreed(self, done) -> None:
        """Raises on every rank after ``fast_allreduce`` found that the ranks' inputs disagree
        (``done``: what it returned)."""
        self.board.failed += 1  # the one C call's collective raised (Board.failed)
        if self.c_exchange is not None:
            exchange.disagreed(self.links, done[1], "allreduce", None)
        if not self.shm().check(done[0], done[1], "allreduce"):
            raise header.mismatch_error("allreduce", done[1], self.topo.rank)

    def links_ready(self) -> Links:
        """The links to hand to the engine for a collective, the node's shared-memory context
        made first where there is one (collective then: every rank asks at the same call)."""
        if self._shm is None and self.facts.shm:
            self.shm()
        return self.links

    def exchange(self, hdr: tuple, operation: str, local_error: Optional[BaseException] = None,
                 data=None, dtype: int = 0, op: int = 0):
        """The header check every collective starts with (mpidp.engine.exchange.exchange):
        every rank's free word, or an error raised on every rank. Collective."""
        return self.links_ready().exchange(hdr, operation, local_error, data, dtype, op)

    @contextlib.contextmanager
    def stamped(self, site: Optional[int]):
        """The block's collectives carry stamp ``site`` (header.site_hash of a name, or
        another rank's stamp; None: nothing done) in their headers where the call site goes
        in debug mode, so the check compares it (Note [Debug fingerprints] in
        mpidp/engine/header.py): one rank's call that comes in another's place raises on
        every rank instead of pairing. The one C call carries it too (the board's stamp when
        it is called: an inner block may change it); the node's context is made first (a
        collective on its first use: every rank enters the block at the same call)."""
        if site is None:
            yield
            return
        self.links_ready()
        fast, board = self.fast_allreduce, self.board
        if fast is not None:  # a stamp given, else the board's when called (an inner block's)
            self.fast_allreduce = lambda x, op, stamp=0: fast(x, op, stamp or board.site or 0)
        before, board.site = board.site, site
        try:
            yield
        finally:
            board.site = before
            if self.fast_allreduce is not None and not self._closed:
                self.fast_allreduce = fast

    def add_user(self, stop: Callable[[float], bool]) -> None:
        """Registers a thread that calls collectives on its own (the communication thread):
        ``stop(timeout_s)`` ends and joins it, True once it has ended. Note [Stopping the
        users first]."""
        self._users.append(stop)

    @property
    def closed(self) -> bool:
        """This rank's shutdown of the group has begun (``depart``)."""
        return self._closed

    def depart(self) -> None:
        """This rank will call no more collectives on the group (its shutdown has begun):
        ends every wait in the shared-memory context, and tells the other ranks, whose waits
        for this rank then end on every one of them (Note [A rank that has shut down] in
        csrc/shm.c: on the node at once; across nodes by their watchdogs, Note [Watchdog]).
        This rank only; no waiting."""
        self._closed = True
        if self._shm is not None:
            self.fast_allreduce = None
            self._shm.close()
        if self.watchdog is not None:
            self.watchdog.depart()

    def stop_users(self, timeout_s: float = 10.0) -> bool:
        """Note [Stopping the users first]: ends every wait in the shared-memory context
        (``depart``), then stops and joins every registered thread. True when all of them
        ended (also on a later call). This rank only; no communication."""
        self.depart()
        users, self._users = self._users, []
        self._stuck = not all([stop(timeout_s) for stop in users]) or self._stuck
        return not self._stuck

    def comms(self) -> list:
        """Every communicator of mpidp's that the resources hold (the watchdog's; a
        transport's), for a revoke (Note [In-job recovery] in mpidp/runtime/recovery.py)."""
        found = [getattr(t, "comm", None) for t in self.links.transports.values()]
        if self.watchdog is not None:
            found.append(self.watchdog.comm)
        return [c for c in found if c is not None]

    def abandon(self, timeout_s: float = 10.0) -> None:
        """Leaves the resources of a group that lost a rank (its communicators revoked: Note
        [In-job recovery] in mpidp/runtime/recovery.py): every wait in the shared-memory
        context ended, the threads that use the group stopped, the watchdog stopped; nothing
        freed that a collective would free (the communicators and windows are left to the
        process's exit). This rank only; no communication."""
        self._closed = True
        self.fast_allreduce = None
        if self._shm is not None:
            self._shm.close()
        users, self._users = self._users, []
        for stop in users:
            stop(timeout_s)
        if self.watchdog is not None:
            self.watchdog.abandon()
            self.watchdog = None

    def free(self) -> bool:
        """Collective: stops the threads that use the resources, frees transports and the
        node's windows (under the watchdog), then stops the watchdog; True. False, freeing
        nothing, when a thread did not end: it may still use them, and the watchdog goes on
        watching the collective it is in."""
        if not self.stop_users():
            warnings.warn(f"mpidp: rank {self.topo.rank}: a communication thread did not end "
                          "at shutdown; mpidp's windows and communicators are left to the "
                          "process's exit", RuntimeWarning, stacklevel=3)
            return False
        for t in self.links.transports.values():  # NCCL communicators before MPI goes
            if hasattr(t, "free"):
                t.free()
        self.links.transports.clear()
        if self._shm is not None:
            self.fast_allreduce = None
            self.links.shm = None
            with collective(self.topo, "shutdown: freeing the shared-memory windows",
                            check=False):
                self._shm.free()
            self._shm = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        return True
