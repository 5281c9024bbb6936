"""mpidp as a torch.distributed backend: ``dist.init_process_group("mpidp")`` under mpiexec,
mpirun or srun, with no MASTER_ADDR, no port and no socket of mpidp's own, runs torch's
collectives — and torch's DDP, ZeroRedundancyOptimizer, torchmetrics, Lightning — on mpidp's
(mpidp.backend.group, mpidp.backend.ops).

The backend is registered when torch is imported (the ``torch.backends`` entry point torch
loads unless TORCH_DEVICE_BACKEND_AUTOLOAD=0) and by ``import mpidp.backend``; registering
imports nothing but this module and starts nothing: MPI starts when the first process group
is made.

Note [Rendezvous over MPI]
torch finds its store by the init method: ``env://`` by default, which reads MASTER_ADDR and
MASTER_PORT and opens a TCPStore. Under an MPI launcher nothing of that is needed: rank and
world size are MPI's, and the store is served over MPI (mpidp.backend.store). So registering also
adds the ``mpidp://`` init method, and makes ``env://`` fall back to it where MASTER_ADDR is
not set and an MPI launcher started the process (or mpidp is already initialised); with
MASTER_ADDR set, as Lightning and torchrun-style launchers set it, ``env://`` is torch's own
(taking rank and world size from the MPI launcher where RANK and WORLD_SIZE are not set).
torch has no public way to extend ``env://``, so the fallback replaces its entry in torch's
table of rendezvous handlers, keeping the original for every other case.

Note [A lost process under torch]
Where the job runs with fault tolerance (Open MPI's ULFM: Note [In-job recovery] in
mpidp/runtime/recovery.py), a lost process does not end it. The backend's groups are made
under in-job recovery as mpidp's own (every rank a node of its own to the engine, the
watchdog listening for the loss). An operation that meets the loss raises torch's
DistBackendError ("a process of the job was lost"), after revoking every communicator of
mpidp's, so every survivor's operation raises wherever it waits — from the call, from
``wait()``, or from ``backward()`` where DDP's reducer waited (torch's RuntimeError around
it: the Work's future fails in C++ too, mpidp.backend.thread) — and every later operation
of every group raises at once. torch has no way on within a job; the survivors take torch's
own steps of a restart: ``dist.destroy_process_group()`` (which, after a loss, leaves the
groups on this rank only: runtime.free_subgroup) and ``dist.init_process_group(...)``,
whose rendezvous (``_recovered``) remakes the job (mpidp.runtime.world.recover: shrink, and
under MPIDP_RECOVERY=respawn a replacement per lost rank, started with the script's own
command line, whose own init_process_group joins) and makes a new store. The survivors come
first, in their order, and the replacements after them (``keep_ranks=False``), so that rank
0 is a survivor: torch's scripts take rank 0 for the holder of the state (DDP's constructor
broadcasts its parameters; a checkpoint is read there). ``can_recover()`` tells a script
whether to go on so; ``last_recovery()`` what was done. What the state is after a loss is
the script's: a step may have completed on some survivors and not others, so a script
keeps a copy of its state after each whole step (or a checkpoint) and broadcasts rank 0's
after the new init (docs/recovery.md). On an MPI without fault tolerance (MPICH) a lost
rank ends the job, as before."""
from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any, Optional
from urllib.parse import parse_qs, urlparse

BACKEND = "mpidp"
_registered = False


def register() -> None:
    """Registers the "mpidp" backend and the ``mpidp://`` init method with torch.distributed
    (idempotent; this process only)."""
    global _registered
    if _registered:
        return
    import torch.distributed as dist  # deferred for cost: this module is torch's plugin
    # the module (torch.distributed's attribute of that name is the function)
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    if "mpidp" not in rdzv._rendezvous_handlers:
        dist.register_rendezvous_handler("mpidp", _mpi_rendezvous)
    if not getattr(dist.monitored_barrier, "mpidp_dispatch", False):
        dist.monitored_barrier = _monitored_barrier_or(dist.monitored_barrier)
    env = rdzv._rendezvous_handlers.get("env")
    if env is not None and not getattr(env, "mpidp_fallback", False):
        rdzv._rendezvous_handlers["env"] = _env_or_mpi(env)
    _registered = True


def autoload() -> None:
    """torch's ``torch.backends`` entry point: registers the backend and never raises (an
    error here would fail ``import torch``)."""
    try:
        register()
    except Exception as exc:  # noqa: BLE001 - anything: torch must still import
        warnings.warn(f"mpidp: the torch.distributed backend was not registered: {exc}; "
                      "call mpidp.backend.register() to see why", RuntimeWarning, stacklevel=2)


def _create(opts, backend_options):
    from .group import create  # deferred for cost: registering imports no collective
    return create(opts, backend_options)


def _launched_by_mpi() -> bool:
    from ..runtime import launcher  # deferred for cost, as above
    from .. import runtime
    return runtime.is_initialized() or launcher.launcher_view() is not None


def _env_or_mpi(original):
    def handler(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
        if "MASTER_ADDR" not in os.environ and _launched_by_mpi():
            return _mpi_rendezvous(url, timeout=timeout, **kwargs)
        return original(_with_launcher_rank(url), timeout=timeout, **kwargs)
    handler.mpidp_fallback = True
    return handler


def _with_launcher_rank(url: str) -> str:
    """``url`` with the MPI launcher's rank and world size where neither it nor RANK and
    WORLD_SIZE give them: under mpiexec or srun, MASTER_ADDR and MASTER_PORT suffice."""
    from ..runtime import launcher  # deferred for cost, as above
    parts = urlparse(url)
    query = parse_qs(parts.query)
    view = launcher.launcher_view()
    if view is None or view.rank is None or view.size is None:
        return url
    extra = [f"{name}={value}" for name, env, value in (
        ("rank", "RANK", view.rank), ("world_size", "WORLD_SIZE", view.size))
        if name not in query and env not in os.environ]
    if not extra:
        return url
    return parts._replace(query="&".join(filter(None, [parts.query] + extra))).geturl()


def _mpi_rendezvous(url: str, timeout: timedelta = timedelta(minutes=30), **kwargs):
    """Yields (store, rank, world size) of mpidp's group, starting it (Note [Rendezvous over
    MPI]); a rank or world size in ``url`` must be MPI's."""
    from .. import runtime  # deferred for cost, as above
    from ..runtime import mpi  # deferred for cost, as above
    from .store import MPIStore
    g = _recovered() or runtime.init()
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    for name, mine in (("rank", g.rank), ("world_size", g.size)):
        if name in query and int(query[name]) not in (-1, mine):
            raise ValueError(f"init_process_group: {name}={query[name]} but MPI says "
                             f"{mine}; under an MPI launcher leave rank and world_size out")
    comm = mpi.dup(g.user_comm)
    store = MPIStore(comm, timeout)

    def stop(timeout_s: float) -> bool:
        _destroy_torch_groups()
        ended = store.close(timeout_s)
        if ended:
            mpi.free(comm)
        return ended
    g.resources.add_user(stop)
    yield store, g.rank, g.size
    raise RuntimeError("the mpidp:// rendezvous runs once per process")


def can_recover() -> bool:
    """Whether this process met a lost process of the job (torch's operations raised
    DistBackendError) and the job runs with in-job recovery, so that ``init_process_group``
    again, after ``destroy_process_group``, goes on with the survivors and the replacements
    (Note [A lost process under torch]). Not collective."""
    from .. import runtime  # deferred for cost, as above
    from ..runtime import recovery
    return runtime.is_initialized() and runtime.init_group().recovery != "off" and \
        recovery.pending()


def last_recovery() -> Optional[dict]:
    """What the last recovery of this process's ``init_process_group`` did (Note [A lost
    process under torch]): ``lost`` (the ranks lost, as they were numbered), ``before`` and
    ``size`` (the world's sizes), ``replaced``, ``seconds``; None before any. This process's
    own view: a replacement has none."""
    return _last_recovery


_last_recovery: Optional[dict] = None


def _recovered():
    """The job's group remade after a lost process (``can_recover``), the survivors first and
    the replacements after them, its line on the new rank 0; None where there is nothing to
    recover from. Every survivor calls it, in its init_process_group."""
    global _last_recovery
    if not can_recover():
        return None
    from .. import runtime  # deferred for cost, as above
    from ..runtime import recovery, world
    start, before = time.perf_counter(), runtime.size()
    g, lost, replaced, _ = world.recover(keep_ranks=False)
    seconds = time.perf_counter() - start
    _last_recovery = {"lost": list(lost), "before": before, "size": g.size,
                      "replaced": replaced, "seconds": round(seconds, 3)}
    if g.rank == 0:
        new = list(range(g.size - len(lost), g.size))
        after = "" if not replaced else (
            f"; rank {new[0]} is the replacement" if len(new) == 1 else
            f"; ranks {', '.join(map(str, new))} are the replacements")
        sys.stderr.write(f"mpidp.backend: in-job recovery: "
                         f"{recovery.describe(lost, before, g.size, replaced)}; the job remade "
                         f"in {seconds:.2f} s, the survivors first (rank 0 is one){after}\n")
        sys.stderr.flush()
    return g


def _destroy_torch_groups() -> None:
    """torch's process groups, destroyed while the interpreter and the store over MPI still
    live: left to the interpreter's end (scripts rarely call destroy_process_group; Lightning
    does not), a gloo group's threads were seen to abort the process ("terminate called
    without an active exception") after the store and MPI had gone."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - at exit, a group torch already tore down
            pass


def _monitored_barrier_or(original):
    """torch.distributed.monitored_barrier serving mpidp's groups too (torch's own raises
    "only implemented for GLOO backend" for any other; Note [Rendezvous over MPI] says why
    registering replaces torch's entry): an mpidp group's goes to ``monitored_barrier``
    below, any other group to torch's."""
    import torch.distributed as dist  # deferred for cost, as above

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        c10d = dist.distributed_c10d
        if dist.is_initialized() and group is not c10d.GroupMember.NON_GROUP_MEMBER:
            from .group import ProcessGroup
            pg = c10d._get_default_group() if group is None else group
            if isinstance(pg, ProcessGroup):
                return pg.monitored_barrier(timeout, wait_all_ranks)
        return original(group, timeout, wait_all_ranks)
    monitored_barrier.mpidp_dispatch = True
    return monitored_barrier


def process_group_for_join():
    """torch.distributed's default group, which torch's Join all-reduces on, started on the
    mpidp backend (over mpidp's group) where torch.distributed is not initialised yet
    (Note [Uneven inputs] in mpidp/ddp/join.py). Every rank calls it."""
    import torch.distributed as dist  # deferred for cost, as above
    if not dist.is_initialized():
        register()
        dist.init_process_group(BACKEND, init_method="mpidp://")
    return dist.distributed_c10d._get_default_group()


def monitored_barrier(group: Any = None, timeout: Optional[timedelta] = None,
                      wait_all_ranks: bool = False) -> None:
    """torch.distributed.monitored_barrier for the mpidp backend (which torch's serves too
    once mpidp is registered): rank 0 raises a RuntimeError naming the rank (with
    ``wait_all_ranks`` every rank) that did not arrive within ``timeout``. Every rank of
    ``group`` (default: the default group) calls it."""
    import torch.distributed as dist  # deferred for cost, as above
    from .group import ProcessGroup
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if not isinstance(pg, ProcessGroup):
        raise TypeError(f"monitored_barrier: {pg!r} is not a process group of the mpidp "
                        "backend; torch.distributed.monitored_barrier serves gloo's")
    pg.monitored_barrier(timeout, wait_all_ranks)


autoload()
