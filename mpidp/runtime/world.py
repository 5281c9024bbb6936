"""The process group mpidp runs on (read as ``mpidp.runtime``: Note [The runtime's front]): ``init`` (its topology and resources, the settings that
must agree across ranks), ``shutdown``, rank queries, and the abort of the whole job when any
rank dies of an uncaught exception."""
from __future__ import annotations

import atexit
import contextlib
import contextvars
import dataclasses
import socket
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Optional

from .. import config
from . import launcher, recovery, timeline
from .abort import abort_job
from ..errors import ConfigError, LaunchError, MismatchError, NotInitializedError
from ..engine.gpu.device import bind_if_visible
from .resources import Resources
from .topology import Topology
from .frame import collective
from .mpi import THREAD_LEVELS, thread_level  # noqa: F401 - the runtime's names
from ..engine.library import mpi


class Group(Topology):
    """mpidp's process group: its topology (mpidp.runtime.topology, fixed after init) and the
    ``resources`` its collectives use (mpidp.runtime.resources), among them the watchdog's ``board``."""

    __slots__ = ("resources", "board", "recovery", "cfg")

    def __init__(self, user_comm: Any, cfg: config.Config, recovery_mode: str = "off"):
        # under in-job recovery every rank is a node of its own to the engine (Note [In-job
        # recovery] in mpidp/runtime/recovery.py)
        if recovery_mode != "off":
            cfg = dataclasses.replace(cfg, emulate_node_size=1)
        super().__init__(user_comm, cfg.emulate_node_size)
        self.cfg, self.recovery = cfg, recovery_mode
        self.resources = Resources(self, cfg)
        self.board = self.resources.board

    def free(self) -> None:
        """Collective: frees the resources (under the watchdog, which stops last), then the
        communicators; neither while a thread of mpidp's still uses them (Note [Stopping the
        users first] in mpidp/runtime/resources.py)."""
        if self.resources.free():
            super().free()


def _agreed_settings(comm: Any) -> config.Config:
    """This rank's settings (config.get) once every rank of ``comm`` has read its own: on
    every rank, a ConfigError where some rank's MPIDP_* value is bad (Note [Settings read at
    init] in mpidp/config.py: this rank's own, else the first bad rank's, "rank r: " before
    it), a MismatchError where ranks started with different settings of the algorithms
    (config.AGREED), a ConfigError where one cannot apply to a group of this size. Runs first
    in init, before any collective those settings shape (the node split among them); every
    rank of ``comm`` calls it, in one exchange, so that no rank waits for one that raised."""
    try:
        cfg, bad = config.get(), None
    except ConfigError as exc:
        cfg, bad = None, exc
    if comm.Get_size() > 1:
        mine = (None, config.agreed(cfg)) if bad is None else \
            ((bad.variable, bad.value, bad.expected), None)
        everyone = comm.allgather(mine)
        if bad is None:
            for r, (fields, _) in enumerate(everyone):
                if fields is not None:
                    raise ConfigError(*fields, where=f"rank {r}: ")
            _check_agreement(comm, [agreed for _, agreed in everyone])
    if bad is not None:
        raise bad
    config.check_group_size(cfg, comm.Get_size())
    return cfg


def _recovery_mode(cfg: config.Config) -> str:
    """What MPIDP_RECOVERY means in this job (mpidp.runtime.recovery.mode), or a ConfigError
    naming the library: the same on every rank (one library, one job)."""
    try:
        return recovery.mode(cfg.recovery)
    except ValueError as exc:
        raise ConfigError("MPIDP_RECOVERY", cfg.recovery, str(exc).split(": ", 1)[1]) from None


def _check_agreement(comm: Any, everyone: list) -> None:
    """MismatchError (on every rank: each has ``everyone``) naming each rank's value of every
    setting of config.AGREED where ranks differ."""
    differ = [name for k, name in enumerate(config.AGREED)
              if len({e[k] for e in everyone}) > 1]
    if differ:
        raise MismatchError(
            f"rank {comm.Get_rank()}: ranks were started with different settings, which must "
            "agree: "
            + "; ".join(f"{config.env_name(name)}: " + ", ".join(
                f"rank {r}={e[config.AGREED.index(name)]!r}" for r, e in enumerate(everyone))
                for name in differ) + " (every rank raises this error)")


_group: Optional[Group] = None
_lock = threading.RLock()  # re-entered: shutdown's users may free sub-groups (free_subgroup)
# Note [Sub-groups]: the group a thread's collectives run on while it is inside ``using``
_current: contextvars.ContextVar = contextvars.ContextVar("mpidp_group", default=None)
_subgroups: list = []  # made by ``subgroup``, freed by ``shutdown`` before the group

# Note [Sub-groups]
# Every torch.distributed group of the mpidp backend (mpidp.backend), the default one too, is a
# Group of its own over a communicator of some or all of the group's ranks: its own topology,
# shared memory, watchdog and board — so torch's asynchronous operations, on their group's
# thread, never share an order with mpidp's own collectives (its DDP's thread, the user's
# calls), which would then differ between ranks. mpidp's
# collectives read their group from ``group()``, which is the group made by ``init`` unless
# the calling thread is inside ``using(g)``. Sub-groups are freed at shutdown, before the
# group, in the order they were made (the same order on every member, as Group.free is
# collective over the sub-group), or earlier by ``free_subgroup`` (torch's
# destroy_process_group), in the order its callers call it.


def init(comm: Any = None) -> Group:
    """Starts MPI (thread level MULTIPLE) and builds mpidp's group on ``comm`` (default
    COMM_WORLD; a sub-communicator combines data parallelism with the user's own model
    parallelism). Idempotent: later calls return the same group; a different ``comm`` after
    the first is a ValueError. LaunchError when a launcher started this process as one of N
    independent singletons (pass ``MPI.COMM_SELF`` to run one alone on purpose). ConfigError
    (a ValueError) on every rank where a rank's MPIDP_* value is bad, MismatchError where
    ranks' settings differ (``_agreed_settings``). Every rank of ``comm`` must call it."""
    with _lock:
        launcher.prepare_mpi_start()  # Note [PMI-1 lines under srun] in mpidp/runtime/launcher.py
        # a replacement that cannot join ends itself: Note [A replacement that cannot join]
        with recovery.joined_within(_group is None and comm is None):
            return _started(comm)


def _started(comm: Any) -> Group:
    """``init``'s work, under its lock: MPI started, the group (this process's, or ``comm``'s
    where given) made or the one made before returned."""
    global _group
    MPI = mpi()
    if comm is None and _group is not None:
        return _group
    if comm is None:  # a replacement of a lost rank joins the job: Note [In-job recovery]
        comm = (recovery.join_parent() if recovery.REPLACEMENT in sys._xoptions else None) \
            or MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py Intracomm, got {comm!r}")
    if _group is not None:
        if MPI.Comm.Compare(_group.user_comm, comm) not in (MPI.IDENT, MPI.CONGRUENT):
            raise ValueError("mpidp.init() was already called with another communicator")
        return _group
    if comm == MPI.COMM_WORLD:
        # Note [Independent singletons] in mpidp/runtime/launcher.py
        reason = launcher.independent_singletons(comm.Get_size())
        if reason is not None:
            raise LaunchError(f"mpidp: {reason}")
    cfg = _agreed_settings(comm)
    group = _start_group(comm, cfg, _recovery_mode(cfg))
    _group = group
    bind_if_visible(group.local_rank)  # before any CUDA work of the user's (imports nothing)
    atexit.register(_at_exit)
    return group


def _at_exit() -> None:
    """mpidp's shutdown at the interpreter's exit; in a job that lost a process (a user's
    script too: torch's, Horovod's elastic), MPI finalised here, within
    recovery.FINALIZE_AFTER_LOSS_S, rather than left to wait for ever in mpi4py's finalisation
    (Note [Ending a job that lost a process] in mpidp/runtime/recovery.py)."""
    if recovery.lost_in_this_job():
        finalize_within(recovery.FINALIZE_AFTER_LOSS_S)
    else:
        shutdown()


def _start_group(comm: Any, cfg: config.Config, recovery_mode: str) -> Group:
    """The group on ``comm`` with its watchdog (and the timeline, where it records), as init
    makes it and a recovery remakes it. Every rank of ``comm`` calls it."""
    MPI = mpi()
    timeline.switch(bool(cfg.timeline))  # Note [Timeline cost]
    try:
        group = Group(comm, cfg, recovery_mode)
    except BaseException:  # no group: nothing records, as before init
        timeline.switch(False)
        raise
    if cfg.abort_on_exception:
        _install_abort_hooks(group)
    group.resources.start_watchdog(cfg.timeout_s)
    if comm == MPI.COMM_WORLD and group.cfg.emulate_node_size == 0:
        for problem in launcher.disagreements(launcher.launcher_view(), group.rank,
                                              group.size, group.local_rank, group.local_size):
            warnings.warn(f"mpidp: rank {group.rank}: {problem}", RuntimeWarning, stacklevel=3)
    if timeline.ON:
        try:
            with collective(group, "init: starting the timeline", check=False):
                timeline.start(group.comm, cfg.timeline)
        except BaseException:  # raised on every rank: nothing of this group survives
            timeline.switch(False)
            group.free()
            raise
    return group


def revoke_all() -> None:
    """Revokes every communicator of mpidp's groups, sub-groups too, after a lost process
    (recovery.revoke): every survivor's wait on them ends, wherever it is. This rank only."""
    with _lock:
        everyone = (*_subgroups, *([_group] if _group is not None else []))
        recovery.revoke([c for g in everyone for c in (*g.comms(), *g.resources.comms())])


def recover(keep_ranks: bool = True) -> tuple:
    """The survivors' side of Note [In-job recovery] (mpidp/runtime/recovery.py), after an
    MPI call reported a lost process (recovery.is_process_failure): revokes every
    communicator of mpidp's groups, leaves their resources (sub-groups gone: their users
    remake them), shrinks the job's communicator, respawns the lost ranks where the group's
    mode is ``respawn`` (each at the rank it replaces, or without ``keep_ranks`` after the
    survivors: recovery.respawn), and makes the group anew as ``init`` made it (the
    replacements' ``init`` joins it). Returns (the new group, the ranks lost, whether they
    were replaced, this rank's seconds in each phase: leave_s, shrink_s, spawn_s where
    respawned (the replacements' start and their joining), group_s).
    Every survivor calls it; RuntimeError where the group is not under in-job recovery."""
    global _group
    with _lock:
        old = init_group()
        if old.recovery == "off":
            raise RuntimeError("mpidp: this group was not made for in-job recovery "
                               "(MPIDP_RECOVERY)")
        clock = [time.perf_counter()]

        def lap() -> float:  # seconds since the last lap
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 6)
        everyone = (*_subgroups, old)
        revoke_all()
        for g in everyone:
            g.resources.abandon()
        _subgroups.clear()
        phases = {"leave_s": lap()}
        survivors, lost = recovery.shrink(old.user_comm)
        phases["shrink_s"] = lap()
        comm = survivors
        if old.recovery == "respawn" and lost:
            comm = recovery.respawn(survivors, lost, recovery.command(), keep_ranks)
            phases["spawn_s"] = lap()
        cfg = _agreed_settings(comm)
        _group = _start_group(comm, cfg, old.recovery)
        recovery.recovered()
        phases["group_s"] = lap()
        return _group, lost, comm is not survivors, phases


def shutdown() -> None:
    """Frees mpidp's communicators and windows (also at exit, before MPI finalises)."""
    global _group
    with _lock:
        if _group is not None:
            MPI = mpi()
            if recovery.pending():  # a lost process not recovered from: left, not freed
                for g in (*_subgroups, _group):
                    g.resources.abandon()
                _subgroups.clear()
            elif not MPI.Is_finalized():
                # every group first: a rank another waits for on one group must not first
                # wait on another group's shutdown (Note [A rank that has shut down] in
                # csrc/shm.c)
                for g in (*_subgroups, _group):
                    g.resources.depart()
                for sub in _subgroups:
                    sub.resources.stop_users()
                    sub.free()
                _subgroups.clear()
                _group.resources.stop_users()  # Note [Stopping the users first]
                records = None
                if timeline.ON:
                    with collective(_group, "shutdown: gathering the timeline", check=False):
                        records = timeline.gather()
                _group.free()  # stops the watchdog
                timeline.write(records)
            _group = None


def finalize_within(seconds: float) -> None:
    """mpidp's shutdown and MPI_Finalize, this process ended (exit code 1, its stacks on
    stderr) where they have not returned in ``seconds``: Note [Ending a job that lost a
    process] in mpidp/runtime/recovery.py. Called once, last, by the main thread; collective
    as MPI_Finalize is."""
    with recovery.ended_after(seconds):
        shutdown()
        MPI = mpi()
        recovery.leave_dynamic_communicators()
        if not MPI.Is_finalized():
            MPI.Finalize()


def start_timeline(path: str, what: str = "start_timeline", asked: str = "MPIDP_TIMELINE"
                   ) -> None:
    """Starts recording the timeline now, to be written at rank 0's ``path`` (the other
    ranks' are not used) by ``stop_timeline`` or at shutdown: Note [A timeline started while
    running] in mpidp/runtime/timeline.py. Already recording to that file: nothing; to
    another one: that one is written first. A ValueError on every rank where rank 0 cannot
    write there (``what`` names the call in it); a RuntimeWarning where ``asked``, the
    variable that asks for the timeline, was set after mpidp's modules were imported.
    Collective over the group made by ``init``: every rank calls it, having agreed on the call
    (mpidp.comm.agreement.called)."""
    with _lock:
        g = init_group()
        if g.size > 1:
            with collective(g, "starting the timeline: rank 0's file", check=False):
                path = g.comm.bcast(path, root=0)
        if timeline.ON:
            if timeline.started_path() == path:
                return
            stop_timeline()
        _record(True, asked)
        try:
            with collective(g, "starting the timeline", check=False):
                timeline.start(g.comm, path, what)
        except BaseException:  # raised on every rank: nothing records
            _record(False)
            raise


def stop_timeline() -> Optional[str]:
    """Stops recording the timeline and writes it (rank 0, atomically, as at shutdown):
    its path on rank 0, None elsewhere, when none records, or where the write failed (said
    on stderr). Collective over the group made by ``init``: every rank calls it, having
    agreed on the call (mpidp.comm.agreement.called)."""
    with _lock:
        g = init_group()
        if not timeline.ON:
            return None
        with collective(g, "stopping the timeline: gathering it", check=False):
            records = timeline.gather()
        _record(False)
        return timeline.write(records)


def _record(on: bool, asked: str = "MPIDP_TIMELINE") -> None:
    """Recording on or off, for every group's one-call path too (Resources.record)."""
    timeline.switch(on, asked)
    for g in (_group, *_subgroups):
        if g is not None:
            g.resources.record()


def subgroup(ranks) -> Group:
    """A Group of the ranks ``ranks`` (ranks of the group made by ``init``, in the order
    given) with its own watchdog: Note [Sub-groups]. Collective over those ranks only; this
    rank must be one of them."""
    g = group()
    ranks = [int(r) for r in ranks]
    if g.rank not in ranks:
        raise ValueError(f"rank {g.rank} is not one of the sub-group's ranks {ranks}")
    comm = g.user_comm.Create_group(g.user_comm.Get_group().Incl(ranks))
    cfg = config.get()
    sub = Group(comm, cfg, g.recovery)  # under in-job recovery too (Note [In-job recovery])
    sub.resources.start_watchdog(cfg.timeout_s)
    with _lock:
        _subgroups.append(sub)
    return sub


def free_subgroup(sub: Group) -> bool:
    """Frees sub-group ``sub`` now rather than at shutdown (torch's destroy_process_group:
    Note [Sub-groups]); True if this call freed it, False if it was freed already (by an
    earlier call or by shutdown). Collective over the sub-group's ranks, which free their
    sub-groups in the same order — except after a lost process, before the recovery
    (recovery.pending): then it is left, on this rank only."""
    with _lock:
        if sub not in _subgroups:
            return False
        _subgroups.remove(sub)
        MPI = mpi()
        if recovery.pending():  # its ranks may be lost: left, this rank only
            sub.resources.abandon()
        elif not MPI.Is_finalized():
            sub.resources.stop_users()
            sub.free()
        return True


@contextlib.contextmanager
def using(g: Group):
    """mpidp's collectives called by this thread inside the block run on ``g`` (a sub-group:
    Note [Sub-groups])."""
    token = _current.set(g)
    try:
        yield g
    finally:
        _current.reset(token)


def group() -> Group:
    """The group this thread's collectives run on: the one made by ``init``, or the
    sub-group of an enclosing ``using``; NotInitializedError before ``init``."""
    g = _current.get()
    if g is None:
        g = _group
    if g is None:
        raise NotInitializedError("call mpidp.init() on every rank before using mpidp")
    return g


def init_group() -> Group:
    """The group made by ``init``, also inside a ``using`` block; NotInitializedError before."""
    if _group is None:
        raise NotInitializedError("call mpidp.init() on every rank before using mpidp")
    return _group


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
    MPI = mpi()

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
