"""Horovod's basics, as ``horovod.torch`` names them, on mpidp's runtime: init and shutdown,
ranks and sizes (the node-crossing ones included), the timeline started and stopped while
running, the build queries answered for what mpidp is, and the reduction ops' constants."""
from __future__ import annotations

import os
from typing import Any, Optional

from .. import config, runtime
from ..comm import agreement
from ..engine import header
from ..errors import NotInitializedError
from . import process_sets as process_sets_
from . import settings

# Horovod's ReduceOp values, so that a script that stores or compares them sees the numbers
# it knows
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5


class HorovodInternalError(RuntimeError):
    """Horovod's error for a collective that failed inside Horovod (horovod.common.exceptions);
    mpidp's collectives raise mpidp's errors, so scripts catch it and find nothing new."""
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
            Product: "Product"}


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Horovod's ``init``: starts mpidp (MPI) on ``comm``, an mpi4py communicator (default
    COMM_WORLD), with the HOROVOD_* variables mpidp maps (mpidp/horovod/settings.py), then
    adds ``process_sets`` (a list of hvd.ProcessSet; "dynamic" or None: none; sets can
    always be added later). A list of ranks for ``comm`` is refused in one line."""
    if isinstance(comm, (list, tuple)):
        raise NotImplementedError("mpidp.horovod: init(comm=<list of ranks>) is not supported; "
                                  "pass an mpi4py communicator (MPI.COMM_WORLD.Split)")
    if process_sets not in (None, "dynamic") and not isinstance(process_sets, (list, tuple)):
        raise ValueError(f"process_sets must be a list of hvd.ProcessSet or 'dynamic', got "
                         f"{process_sets!r}")
    if not runtime.is_initialized():
        config.adopt(settings.mapped)  # HOROVOD_* variables: mapped, or one line refusing
    runtime.init(comm)
    process_sets_.started()
    for ps in process_sets if isinstance(process_sets, (list, tuple)) else ():
        process_sets_.add_process_set(ps)


def shutdown() -> None:
    process_sets_.forget()
    runtime.shutdown()


def is_initialized() -> bool:
    return runtime.is_initialized()


NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."
START, STOP = "hvd.start_timeline", "hvd.stop_timeline"
for _name in (START, STOP):  # every rank can name what another rank called (header.describe)
    header.other_header(_name)


def start_timeline(file_path, mark_cycles=False) -> None:
    """Horovod's: records the timeline from now on, to be written at rank 0's ``file_path``
    (the others' are not used) by ``stop_timeline`` or at shutdown; to a file being recorded
    already, nothing; to another, that one is written first (Note [A timeline started while
    running] in mpidp/runtime/timeline.py). Needs HOROVOD_TIMELINE (``DYNAMIC``: none until
    now) or MPIDP_TIMELINE set, as Horovod needs HOROVOD_TIMELINE: a ValueError otherwise.
    ``mark_cycles``: accepted, nothing marked (mpidp has no background cycle). Every rank
    calls it (Horovod: rank 0's call alone matters); a rank that calls another operation
    meanwhile, or refuses its call, raises on every rank (Note [Agreement before refusal] in
    mpidp/comm/agreement.py)."""
    if not runtime.is_initialized():
        raise ValueError(NOT_INITIALIZED)
    path, failed = None, None
    try:
        if not config.timeline_requested():
            raise ValueError("Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage.")
        path = os.fspath(file_path)
        if not isinstance(path, str) or not path.strip():
            raise ValueError(f"file_path must name a file, got {file_path!r}")
    except (TypeError, ValueError) as exc:
        failed = exc
    with process_sets_.on(None):  # after pending operations and the buckets in flight
        agreement.called(runtime.init_group(), START, failed)
        runtime.start_timeline(path, "hvd.start_timeline file_path", "HOROVOD_TIMELINE")


def stop_timeline() -> None:
    """Horovod's: stops recording the timeline and writes it at the path rank 0 gave
    ``start_timeline`` (nothing where none records). Every rank calls it, as
    ``start_timeline``."""
    if not runtime.is_initialized():
        raise ValueError(NOT_INITIALIZED)
    with process_sets_.on(None):
        agreement.called(runtime.init_group(), STOP)
        runtime.stop_timeline()


def _group():
    if not runtime.is_initialized():
        raise NotInitializedError("Horovod has not been initialized; use hvd.init().")
    return runtime.group()


# Horovod's names for mpidp's own (which say "call mpidp.init()" before init)
size, rank, local_size, local_rank = runtime.size, runtime.rank, runtime.local_size, \
    runtime.local_rank


def _local_rank_of() -> list:
    """Every rank's local rank (its place among its node's ranks, in rank order)."""
    g = _group()
    seen: dict = {}
    out = []
    for r in range(g.size):
        node = g.node_of[r]
        out.append(seen.get(node, 0))
        seen[node] = out[-1] + 1
    return out


def cross_size() -> int:
    """How many ranks share this rank's local rank (one per node where nodes are alike)."""
    mine = local_rank()
    return sum(1 for lr in _local_rank_of() if lr == mine)


def cross_rank() -> int:
    """This rank's place among the ranks of its local rank, in rank order (its node's index
    where nodes are alike)."""
    lrs, me = _local_rank_of(), rank()
    return sum(1 for r in range(me) if lrs[r] == lrs[me])


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    g = _group()
    counts = [g.node_of.count(k) for k in range(g.node_count)]
    return len(set(counts)) == 1


# the build queries: what this runtime is (MPI underneath; no gloo, NCCL only in mpidp's GPU
# path, which is not Horovod's NCCL build)
def mpi_built(verbose: bool = False) -> bool:
    return True


def mpi_enabled() -> bool:
    return True


def mpi_threads_supported() -> bool:
    return runtime.thread_level() == "multiple"


def gloo_built(verbose: bool = False) -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built(verbose: bool = False) -> bool:
    return False


def ddl_built(verbose: bool = False) -> bool:
    return False


def ccl_built(verbose: bool = False) -> bool:
    return False


def cuda_built(verbose: bool = False) -> bool:
    import torch  # deferred for cost
    return torch.backends.cuda.is_built()


def rocm_built(verbose: bool = False) -> bool:
    return False


def op_name(op: Optional[int]) -> str:
    return OP_NAMES.get(op, repr(op))
