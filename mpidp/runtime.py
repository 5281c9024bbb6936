"""The process group mpidp runs on: ``init``, rank and node topology, the abort of the
whole job when any rank dies of an uncaught exception, and its watchdog (mpidp.watchdog)."""
from __future__ import annotations

import atexit
import socket
import sys
import threading
import traceback
import warnings
from typing import Any, Optional

from . import config, launcher, timeline
from .errors import LaunchError, NotInitializedError
from .abort import abort_job
from .watchdog import Board, Watchdog, collective


class Group:
    """A communicator with its node topology and the per-communicator state collectives need.

    ``node_comm`` holds the ranks of this node (or of an emulated node), ``leader_comm`` the
    local rank 0 of every node (None on other ranks)."""

    def __init__(self, comm: Any, emulate_node_size: int = 0):
        from mpi4py import MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if emulate_node_size > 0:
            self.node_comm = comm.Split(self.rank // emulate_node_size, self.rank)
        else:
            self.node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank)
        self.local_rank, self.local_size = self.node_comm.Get_rank(), self.node_comm.Get_size()
        is_leader = self.local_rank == 0
        leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, self.rank)
        self.leader_comm = leaders if is_leader else None
        self.node_count = comm.allreduce(1 if is_leader else 0)
        self.node_index = leaders.Get_rank() if is_leader else -1
        self.node_index = self.node_comm.bcast(self.node_index, root=0)
        # Note [Auto choice] in mpidp/algorithms.py: one node means shm at every size
        self.auto_is_shm = self.node_count == 1 and config.get().algorithm == "auto"
        self._shm = None   # mpidp.shm.ShmContext of node_comm, made on first use
        self.transports = {}  # id(communicator) -> the ring's MPITransport on it
        self.board = Board(config.get().debug)  # Note [Watchdog] in mpidp/watchdog.py
        self.watchdog: Optional[Watchdog] = None

    @property
    def single_node(self) -> bool:
        return self.node_count == 1

    def shm(self):
        """The shared-memory context of this node's ranks (collective on first use, watched
        as a collective of its own when no collective is under way)."""
        if self._shm is None:
            from .shm import ShmContext
            if self.board.seq == self.board.done:
                with collective(self, "shared-memory set-up", check=False):
                    self._shm = ShmContext(self.node_comm)
            else:
                self._shm = ShmContext(self.node_comm)
        return self._shm

    def free(self) -> None:
        """Collective: frees the node's windows (under the watchdog), then stops it."""
        for transport in self.transports.values():  # NCCL communicators before MPI goes
            if hasattr(transport, "free"):
                transport.free()
        self.transports.clear()
        if self._shm is not None:
            with collective(self, "shutdown: freeing the shared-memory windows", check=False):
                self._shm.free()
            self._shm = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        for c in (self.node_comm, self.leader_comm):
            if c is not None:
                c.Free()
        self.node_comm = self.leader_comm = None


_group: Optional[Group] = None
_lock = threading.Lock()


def init(comm: Any = None) -> Group:
    """Starts MPI (thread level MULTIPLE) and builds mpidp's group on ``comm`` (default
    COMM_WORLD; a sub-communicator combines data parallelism with the user's own model
    parallelism). Idempotent: later calls return the same group; a different ``comm`` after
    the first is a ValueError. LaunchError when a launcher started this process as one of N
    independent singletons (pass ``MPI.COMM_SELF`` to run one alone on purpose). Every rank of
    ``comm`` must call it."""
    global _group
    with _lock:
        from mpi4py import MPI
        if comm is None:
            comm = MPI.COMM_WORLD
        if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
            raise TypeError(f"comm must be an mpi4py Intracomm, got {comm!r}")
        if _group is not None:
            if MPI.Comm.Compare(_group._user_comm, comm) not in (MPI.IDENT, MPI.CONGRUENT):
                raise ValueError("mpidp.init() was already called with another communicator")
            return _group
        if comm == MPI.COMM_WORLD:
            # Note [Independent singletons] in mpidp/launcher.py
            reason = launcher.independent_singletons(comm.Get_size())
            if reason is not None:
                raise LaunchError(f"mpidp: {reason}")
        cfg = config.get()
        group = Group(comm.Dup(), cfg.emulate_node_size)
        group._user_comm = comm
        if cfg.abort_on_exception:
            _install_abort_hooks(group)
        if group.size > 1:
            group.watchdog = Watchdog(group, cfg.timeout_s)
        if comm == MPI.COMM_WORLD and cfg.emulate_node_size == 0:
            for problem in launcher.disagreements(launcher.launcher_view(), group.rank,
                                                  group.size, group.local_rank, group.local_size):
                warnings.warn(f"mpidp: rank {group.rank}: {problem}", RuntimeWarning, stacklevel=2)
        if timeline.ON:
            try:
                with collective(group, "init: starting the timeline", check=False):
                    timeline.start(group.comm)
            except BaseException:  # raised on every rank: nothing of this group survives
                group.free()
                group.comm.Free()
                raise
        _group = group
        from .gpu.device import bind_if_visible
        bind_if_visible(group.local_rank)  # before any CUDA work of the user's (imports nothing)
        atexit.register(shutdown)
        return group


def shutdown() -> None:
    """Frees mpidp's communicators and windows (also at exit, before MPI finalises)."""
    global _group
    with _lock:
        if _group is not None:
            from mpi4py import MPI
            if not MPI.Is_finalized():
                records = None
                if timeline.ON:
                    with collective(_group, "shutdown: gathering the timeline", check=False):
                        records = timeline.gather()
                _group.free()  # stops the watchdog
                _group.comm.Free()
                timeline.write(records)
            _group = None


def group() -> Group:
    """The group made by ``init``; NotInitializedError before it."""
    g = _group
    if g is None:
        raise NotInitializedError("call mpidp.init() on every rank before using mpidp")
    return g


def is_initialized() -> bool:
    return _group is not None


def rank() -> int:
    """This process's rank in the group."""
    return group().rank


def size() -> int:
    """Number of ranks in the group."""
    return group().size


def local_rank() -> int:
    """Rank among the group's ranks on this node (COMM_TYPE_SHARED split)."""
    return group().local_rank


def local_size() -> int:
    """Number of the group's ranks on this node."""
    return group().local_size


def node_count() -> int:
    """Number of nodes the group spans."""
    return group().node_count


def _abort_message(g: Group, kind: str, exc: BaseException) -> str:
    return (f"mpidp: rank {g.rank} of {g.size} on {socket.gethostname()}: uncaught "
            f"{kind}{type(exc).__name__}: {exc}; aborting the job\n")


def _install_abort_hooks(g: Group) -> None:
    """One rank's uncaught exception aborts every rank (as ``python -m mpi4py`` does)."""
    from mpi4py import MPI

    def abort(kind: str, exc_type, exc, tb) -> None:
        try:
            message = ("".join(traceback.format_exception(exc_type, exc, tb))
                       + _abort_message(g, kind, exc))
        except BaseException:  # a message that cannot be formatted still ends the job
            message = f"mpidp: rank {g.rank}: uncaught {kind}exception; aborting the job\n"
        abort_job(message, 1)

    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)) or MPI.COMM_WORLD.Get_size() == 1:
            return previous(exc_type, exc, tb)
        abort("", exc_type, exc, tb)

    def thread_hook(args):
        if args.exc_type is SystemExit:
            return
        abort(f"in thread {args.thread.name if args.thread else '?'}: ", args.exc_type,
              args.exc_value, args.exc_traceback)

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
