"""The one table of all-reduce algorithms — where each runs, its number in the collective
header, when ``auto`` takes it — and the pure choices made from it: ``choose`` for one
all-reduce and ``plan_bucket`` for a bucket of gradients. Pure data and functions: it imports
nothing of mpidp, so every layer may read it.

Candidates are tried in order and the first enabled one runs (Horovod's operation manager)."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

HOST, DEVICE = "host", "device"


class Facts(NamedTuple):
    """What the choices depend on, fixed for a group once ``mpidp.init`` has run."""

    size: int
    single_node: bool
    shm: bool                 # the C extension is built (the shared-memory algorithm exists)
    hier_min_bytes: int       # MPIDP_HIER_MIN_BYTES
    default: str              # MPIDP_ALGORITHM: what "auto" means for host arrays
    inline_bytes: int = 0     # shm: largest buffer carried in the control block
    max_segments: int = 0     # shm: most tensors a zero-copy bucket may hold
    doubling_max_bytes: int = 64 << 10  # MPIDP_DOUBLING_MAX_BYTES
    one_per_node: bool = False  # every node holds one rank of the group
    checked_chunks: bool = False  # two nodes of one rank, every rank with the C call of
    # csrc/exchange.c: doubling at any size, the data in chunks after the record
    nccl: bool = False        # device arrays: NCCL is installed
    shares_gpu: bool = False  # device arrays: this node has more ranks than GPUs


class Algorithm(NamedTuple):
    name: str
    where: str                # HOST or DEVICE: the arrays it takes
    code: int                 # its number in the collective header (mpidp.engine.header)
    auto: Optional[Callable[[Facts, int], bool]]  # (facts, nbytes): auto takes it; None: never


# Note [Auto choice]: on one node shm wins at every size from 8 B up (bench/RESULTS.md,
# "auto"). Across nodes (bench/RESULTS.md, "Across nodes": two emulated nodes over TCP, one
# rank each), below MPIDP_DOUBLING_MAX_BYTES (64 KiB) recursive doubling with the check in the
# same messages (Note [Checked in the message] in mpidp/engine/doubling.py): 21 us at 8 B and 34-38
# us at 32 KiB, against 37 us and 52 us for the check followed by MPI_Allreduce; from 64 KiB
# MPI_Allreduce after the check moves half the bytes of doubling per rank on more nodes.
# Two nodes of one rank each, with the C call on every rank (Facts.checked_chunks): doubling
# at every size, its data above 64 KiB in pipelined chunks after the records (Note [Chunks
# after the record] in csrc/exchange.c), ahead of MPI_Allreduce from 128 KiB to 32 MiB there
# (bench/RESULTS.md). On more nodes each rank would send log2(p) whole arrays against the
# ring's 2(p-1)/p (unmeasured: 4 nodes of one rank do not fit this machine's 2 cores), so
# there doubling stays below 64 KiB. With several ranks on a node, hier from
# MPIDP_HIER_MIN_BYTES (64 KiB, where shm+ring overtook MPI_Allreduce on one node): its
# shared-memory step sends one node's sum across instead of each rank's; with one rank per
# node hier is a plain ring of the nodes, which MPI's own algorithm matched or beat at every
# size measured, so MPI. Without the C extension: no shm, no hier (on one node too: doubling
# below MPIDP_DOUBLING_MAX_BYTES, its check and data in one exchange, then MPI).
# Note [Auto choice on GPU]: our ring over NCCL where NCCL is installed and every rank has a
# GPU of its own (NCCL refuses two ranks on one GPU); otherwise the host path (staged).
TABLE = (
    Algorithm("shm", HOST, 3, lambda f, n: f.single_node and f.shm),
    Algorithm("doubling", HOST, 8, lambda f, n: n < f.doubling_max_bytes or f.checked_chunks),
    Algorithm("hier", HOST, 4, lambda f, n: f.shm and not f.one_per_node and
              n >= f.hier_min_bytes),
    Algorithm("mpi", HOST, 1, lambda f, n: True),
    Algorithm("ring", HOST, 2, None),
    Algorithm("ring", DEVICE, 5, lambda f, n: f.nccl and not f.shares_gpu),
    Algorithm("staged", DEVICE, 7, lambda f, n: True),
    Algorithm("nccl", DEVICE, 6, None),
)
_ROWS = {where: {a.name: a for a in TABLE if a.where == where} for where in (HOST, DEVICE)}
_AUTO = {where: tuple(a for a in TABLE if a.where == where and a.auto) for where in (HOST, DEVICE)}
NAMES = {where: ("auto",) + tuple(_ROWS[where]) for where in (HOST, DEVICE)}
CODE_NAMES = {a.code: a.name + (" on GPU" if a.where == DEVICE and a.name == "ring" else "")
              for a in TABLE}


def check_name(algorithm, where: str) -> str:
    """``algorithm`` if it names an algorithm for ``where``'s arrays, else ValueError."""
    if not isinstance(algorithm, str) or algorithm not in NAMES[where]:
        raise ValueError(f"unknown algorithm {algorithm!r}"
                         f"{' for device arrays' if where == DEVICE else ''}; accepted: "
                         f"{', '.join(NAMES[where])}")
    return algorithm


def choose(where: str, algorithm: str, facts: Facts, nbytes: int) -> Algorithm:
    """The algorithm to run for ``nbytes`` of ``where``'s arrays: ``algorithm`` itself, or for
    "auto" the first enabled candidate. ValueError for a name that is not one or that cannot
    run on this group."""
    if algorithm == "auto" and where == HOST:
        algorithm = facts.default
    if algorithm == "auto":
        return next(a for a in _AUTO[where] if a.auto(facts, nbytes))
    row = _ROWS[where].get(algorithm) if isinstance(algorithm, str) else None
    if row is None:
        check_name(algorithm, where)
    if row.name in ("shm", "hier") and not facts.shm:
        raise ValueError(f"algorithm {algorithm!r} needs mpidp's C extension, which is not "
                         "built (reinstall with a C compiler present), or use 'auto'")
    if row.name == "shm" and not facts.single_node:
        raise ValueError("algorithm 'shm' needs every rank on one node; this group spans "
                         "more than one node (use 'hier' or 'auto')")
    if row.name in ("ring", "nccl") and where == DEVICE:
        if not facts.nccl:
            raise ValueError(f"algorithm {algorithm!r} runs over NCCL, which is not installed "
                             "(pip install 'mpidp[gpu]'), or use 'staged' or 'auto'")
        if facts.shares_gpu:
            raise ValueError(f"algorithm {algorithm!r} runs over NCCL, which needs one GPU per "
                             "rank; this node has more ranks than GPUs (use 'staged' or "
                             "'auto', or one rank per GPU)")
    return row
