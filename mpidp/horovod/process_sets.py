"""Horovod's process sets on mpidp's sub-groups: ``ProcessSet``, ``global_process_set``,
``add_process_set`` and ``remove_process_set`` while running (Horovod's dynamic process sets,
always on here), and ``init(process_sets=...)``. An operation given ``process_set=`` runs on
that set's sub-group (mpidp.runtime.subgroup, entered with ``runtime.using``), called by the
set's ranks only; roots are global ranks, as in Horovod."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

from .. import runtime
from ..comm import fingerprint
from . import backward, handles
from ..errors import NotInitializedError


class ProcessSet:
    """Horovod's: a sorted list of global ranks, valid (``process_set_id`` set) once added."""

    def __init__(self, ranks_or_comm: Any):
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None
        self._group = None  # the sub-group, on the set's ranks
        if isinstance(ranks_or_comm, (list, tuple, range)):
            if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks_or_comm):
                raise ValueError("ProcessSet takes a list of process ranks (integers), got "
                                 f"{list(ranks_or_comm)!r}")
            self.ranks: Optional[list] = sorted(ranks_or_comm)
        else:
            raise NotImplementedError("mpidp.horovod: a ProcessSet of an MPI communicator is "
                                      "not supported; give the list of its global ranks")

    def size(self) -> Optional[int]:
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> Optional[int]:
        """This rank's place in the set (None where not valid or not a member)."""
        if self.process_set_id is None or not self.included():
            return None
        return self.ranks.index(runtime.init_group().rank)

    def included(self) -> Optional[bool]:
        if self.ranks is None:
            return None
        return runtime.init_group().rank in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


_NOTHING = contextlib.nullcontext()
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_sets: dict = {}  # process_set_id -> ProcessSet, the global one excluded


def started() -> None:
    """After ``init``: the global set holds every rank."""
    global_process_set.ranks = list(range(runtime.init_group().size))


def add_process_set(process_set: Any) -> ProcessSet:
    """Adds a set (a ProcessSet or a list of ranks) and returns it valid. Every rank calls it,
    in the same order, with the same ranks: ranks that differ between ranks, a duplicate of a
    set present, or ranks outside the job raise on every rank — the rank whose set is bad
    its ValueError, every other rank a MismatchError naming each rank's list — before any
    group is made (Note [Agreement before refusal] in mpidp/comm/agreement.py)."""
    if not runtime.is_initialized():
        raise NotInitializedError("Horovod has not been initialized; use hvd.init().")
    g = runtime.init_group()
    handles.run_pending()  # Note [Pending operations] in mpidp/horovod/handles.py
    ps, failed = None, None
    try:
        ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
        if not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) or \
                not 0 <= ps.ranks[0] <= ps.ranks[-1] < g.size:
            raise ValueError(f"a process set takes distinct ranks from 0 to {g.size - 1}, got "
                             f"{ps.ranks!r}")
        if ps.ranks == global_process_set.ranks or \
                any(s.ranks == ps.ranks for s in _sets.values()):
            raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    except (TypeError, ValueError, NotImplementedError) as exc:
        failed = exc
    with _after_buckets():
        fingerprint.check_same(g, [("ranks", None if failed else ps.ranks)],
                               "hvd.add_process_set", "the process set's ranks", failed)
        if ps.included():
            ps._group = runtime.subgroup(ps.ranks)
    ps.process_set_id = max(_sets, default=0) + 1
    _sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Removes an added set (every rank calls it); False for the global set or one not
    valid."""
    if process_set.process_set_id in (None, 0):
        return False
    handles.run_pending()  # Note [Pending operations] in mpidp/horovod/handles.py
    with _after_buckets():  # an optimizer on the set flushes its buckets while it is valid
        _sets.pop(process_set.process_set_id, None)
        process_set.process_set_id = None
        if process_set._group is not None:
            runtime.free_subgroup(process_set._group)
            process_set._group = None
    return True


def _after_buckets():
    """MPI calls of the user's thread after the gradient buckets in flight (Note [Gradients
    during backward] in mpidp/horovod/backward.py)."""
    return backward.gate() if backward.active else _NOTHING


def forget() -> None:
    """At shutdown: every added set becomes invalid (its sub-group goes with mpidp's)."""
    handles.forget()
    for ps in _sets.values():
        ps.process_set_id, ps._group = None, None
    _sets.clear()


def group_of(process_set: Optional[ProcessSet]):
    """The group an operation on ``process_set`` (None: the global set) runs on."""
    if process_set is None or process_set is global_process_set:
        return runtime.init_group()
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be an hvd.ProcessSet, got "
                        f"{type(process_set).__name__}")
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} has not been added (hvd.add_process_set) or was removed")
    if process_set._group is None:
        raise ValueError(f"rank {runtime.init_group().rank} is not in {process_set}: only "
                         "its ranks call operations on it")
    return process_set._group


# Note [Process sets in autograd]
# A differentiable operation keeps its ProcessSet, not the set's group, for its backward: the
# set may be removed (its group freed) before backward runs, and the gradient's collective
# then raises Horovod's "not added or was removed" ValueError on every member, where a freed
# group would fail somewhere inside MPI.
@contextlib.contextmanager
def on(process_set: Optional[ProcessSet], pending: bool = True):
    """Runs the block's collectives on ``process_set``'s group, after the gradient buckets in
    flight (Note [Gradients during backward] in mpidp/horovod/backward.py) and, unless
    ``pending`` is False, after the operations pending (Note [Pending operations] in
    mpidp/horovod/handles.py); yields it."""
    if pending:
        handles.run_pending()
    g = group_of(process_set)
    with _after_buckets(), runtime.using(g):
        yield g


def local_root(process_set: Optional[ProcessSet], root_rank: int) -> int:
    """Global ``root_rank`` as a rank of ``process_set``'s group."""
    ranks = global_process_set.ranks if process_set in (None, global_process_set) else \
        process_set.ranks
    if root_rank not in ranks:
        raise ValueError(f"root_rank {root_rank} is not in the process set {ranks}")
    return ranks.index(root_rank)
