"""The alpha-beta-gamma cost model of all-reduce algorithms and of a data-parallel step: pure
formulas, and the least-squares fit that calibrates them from measured times. No MPI, no torch;
the formulas, their assumptions and where they may be wrong are in docs/scale-model.md.
At the end, the presets they are evaluated on: links, GPUs, systems, models (pure data).

An algorithm's cost is ``Terms`` (counts on its critical path: messages, bytes on a link, bytes
reduced) and a machine is ``Machine`` (seconds per message, per byte moved, per byte reduced);
the time is their dot product, so every formula is linear in the machine's parameters and a
calibration is one linear least-squares problem."""
from __future__ import annotations

import itertools
import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np


class Terms(NamedTuple):
    """Counts on an all-reduce's critical path: ``messages`` and ``link_bytes`` on the
    inter-node link, ``reduced_bytes`` through the reduction, ``node_messages`` and
    ``node_bytes`` on the intra-node link. Multiply by a Machine: ``seconds``."""
    messages: float = 0.0
    link_bytes: float = 0.0
    reduced_bytes: float = 0.0
    node_messages: float = 0.0
    node_bytes: float = 0.0


class Machine(NamedTuple):
    """alpha (``alpha_s``, s per message between nodes), beta (``beta_s_per_byte``, s per
    byte on one inter-node link), gamma (``gamma_s_per_byte``, s per byte of reduction output:
    reading two operands and writing one), and the intra-node link's alpha and beta."""
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    node_alpha_s: float = 0.0
    node_beta_s_per_byte: float = 0.0


def seconds(terms: Terms, machine: Machine) -> float:
    """The time of ``terms`` on ``machine``."""
    return float(sum(t * m for t, m in zip(terms, machine)))


def total(*parts: Terms) -> Terms:
    """The terms of steps run one after another."""
    return Terms(*(sum(column) for column in zip(*parts)))


def _count(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def _nbytes(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) \
            or not value >= 0:
        raise ValueError(f"nbytes must be a number >= 0, got {value!r}")
    return float(value)


def _pof2(p: int) -> int:
    """The largest power of two <= p."""
    return 1 << (p.bit_length() - 1)


# ---- the algorithms on p ranks of one link ------------------------------------------------

def ring(nbytes, ranks, segments: int = 1) -> Terms:
    """The ring (mpidp/engine/ring.py, NCCL's ring): p-1 reduce-scatter steps then p-1 all-gather
    steps, each moving a chunk of n/p bytes: 2(p-1)/p n bytes, (p-1)/p n reduced. With
    ``segments`` pipelining pieces per reduce-scatter step: (p-1)(segments+1) messages. The
    reduction is charged in full: the pieces could hide it behind the next transfer, but
    MPICH moves data only inside MPI calls, and the calibration fits 4x better without
    hiding (docs/scale-model.md, "Calibration")."""
    n, p, s = _nbytes(nbytes), _count("ranks", ranks), _count("segments", segments)
    if p == 1:
        return Terms()
    return Terms(messages=(p - 1) * (s + 1), link_bytes=2 * (p - 1) / p * n,
                 reduced_bytes=(p - 1) / p * n)


def ring_segments(nbytes, ranks, piece_bytes: int) -> int:
    """How many pipelining pieces of at most ``piece_bytes`` one ring chunk is cut into (mpidp's
    ring: MPIDP_RING_PIECE_BYTES, default 1 MiB)."""
    n, p = _nbytes(nbytes), _count("ranks", ranks)
    return max(1, math.ceil(n / p / _count("piece_bytes", piece_bytes)))


def recursive_doubling(nbytes, ranks) -> Terms:
    """MPICH's small-message all-reduce: log2(q) exchanges of all n bytes among q = the largest
    power of two <= p, each followed by a reduction of n; when p is not a power of two the p-q
    extra ranks first hand their data to a partner (1 message, n bytes, n reduced) and get the
    result back at the end (1 message, n bytes)."""
    n, p = _nbytes(nbytes), _count("ranks", ranks)
    q = _pof2(p)
    steps, extra = q.bit_length() - 1, int(p != q)
    return Terms(messages=steps + 2 * extra, link_bytes=(steps + 2 * extra) * n,
                 reduced_bytes=(steps + extra) * n)


def rabenseifner(nbytes, ranks) -> Terms:
    """MPICH's large-message all-reduce: recursive-halving reduce-scatter then
    recursive-doubling all-gather among q = the largest power of two <= p: 2 log2(q) messages,
    2 (q-1)/q n bytes, (q-1)/q n reduced; the same extra steps as recursive doubling when p is
    not a power of two."""
    n, p = _nbytes(nbytes), _count("ranks", ranks)
    q = _pof2(p)
    steps, extra = q.bit_length() - 1, int(p != q)
    return Terms(messages=2 * steps + 2 * extra, link_bytes=(2 * (q - 1) / q + 2 * extra) * n,
                 reduced_bytes=((q - 1) / q + extra) * n)


def mpich(nbytes, ranks, short_bytes: int = 2048, itemsize: int = 4) -> Terms:
    """MPI_Allreduce as MPICH chooses for a built-in op: recursive doubling up to
    ``short_bytes`` (MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE, 2048) or when there are fewer
    elements than the power of two; Rabenseifner above."""
    n, p = _nbytes(nbytes), _count("ranks", ranks)
    if n <= short_bytes or n // _count("itemsize", itemsize) < _pof2(p):
        return recursive_doubling(n, p)
    return rabenseifner(n, p)


# ---- within a node, and across nodes of g ranks each ---------------------------------------

def shm(nbytes, ranks) -> Terms:
    """mpidp's shared-memory all-reduce of g ranks on one node (Note [Shared-memory protocol]
    in csrc/shm.c): one round (two barriers), rank r reads slice r of every peer's input and
    writes the sum into every peer's output: 2 (g-1)/g n bytes through the node's memory,
    (g-1)/g n reduced."""
    n, g = _nbytes(nbytes), _count("ranks", ranks)
    if g == 1:
        return Terms()
    return Terms(node_messages=1, node_bytes=2 * (g - 1) / g * n, reduced_bytes=(g - 1) / g * n)


def broadcast(nbytes, ranks) -> Terms:
    """MPICH's broadcast of a large buffer over p ranks of one link (a scatter down a binomial
    tree, then a ring all-gather): ceil(log2 p) + p - 1 messages, 2 (p-1)/p n bytes."""
    n, p = _nbytes(nbytes), _count("ranks", ranks)
    if p == 1:
        return Terms()
    return Terms(messages=math.ceil(math.log2(p)) + p - 1, link_bytes=2 * (p - 1) / p * n)


def node_broadcast(nbytes, ranks) -> Terms:
    """A broadcast of n bytes to g ranks of a node, at its lower bound: a binomial tree's
    ceil(log2 g) messages and a scatter + all-gather's 2 (g-1)/g n bytes."""
    n, g = _nbytes(nbytes), _count("ranks", ranks)
    return Terms(node_messages=math.ceil(math.log2(g)), node_bytes=2 * (g - 1) / g * n)


def node_reduce(nbytes, ranks) -> Terms:
    """A reduce of n bytes from g ranks of a node to one: node_broadcast's cost plus
    (g-1)/g n reduced (a reduce-scatter + gather)."""
    n, g = _nbytes(nbytes), _count("ranks", ranks)
    return total(node_broadcast(n, g), Terms(reduced_bytes=(g - 1) / g * n))


def hier(nbytes, nodes, per_node, segments: int = 1) -> Terms:
    """mpidp's hierarchical all-reduce (host_backend.hier, Horovod's): shm within each node,
    the ring among the node leaders on the whole buffer, a broadcast within each node."""
    n = _nbytes(nbytes)
    return total(shm(n, per_node), ring(n, nodes, segments), node_broadcast(n, per_node))


def mpi_smp(nbytes, nodes, per_node, short_bytes: int = 2048, itemsize: int = 4) -> Terms:
    """MPICH across nodes with SMP-aware collectives (MPIR_CVAR_ENABLE_SMP_ALLREDUCE): reduce
    to each node's leader, MPI_Allreduce among leaders, broadcast within each node."""
    n, g = _nbytes(nbytes), _count("per_node", per_node)
    if g == 1:
        return mpich(n, nodes, short_bytes, itemsize)
    return total(node_reduce(n, g), mpich(n, nodes, short_bytes, itemsize),
                 node_broadcast(n, g))


def flat_ring(nbytes, nodes, per_node, nics: int, machine: Machine, segments: int = 1) -> Terms:
    """One ring over all nodes x per_node ranks (NCCL's ring), ranks of a node adjacent: every
    step moves n/p bytes over every hop, so the slowest hop sets the pace: a node link, or a
    NIC, of which there are ``nics`` per node carrying as many rings in parallel."""
    n = _nbytes(nbytes)
    N, g, k = _count("nodes", nodes), _count("per_node", per_node), _count("nics", nics)
    r = ring(n, N * g, segments)
    if N == 1:
        return Terms(node_messages=r.messages, node_bytes=r.link_bytes,
                     reduced_bytes=r.reduced_bytes)
    # one rank per node: every hop crosses the network, none stays inside a node
    slow_link = g == 1 or machine.beta_s_per_byte / k >= machine.node_beta_s_per_byte
    slow_alpha = g == 1 or machine.alpha_s >= machine.node_alpha_s
    return Terms(messages=r.messages if slow_alpha else 0,
                 node_messages=0 if slow_alpha else r.messages,
                 link_bytes=r.link_bytes / k if slow_link else 0,
                 node_bytes=0 if slow_link else r.link_bytes, reduced_bytes=r.reduced_bytes)


def parameter_server(nbytes, workers, servers, per_link: float = 1.0) -> Terms:
    """Pull then push of the whole model by W workers from and to S servers holding 1/S of it
    each: per direction a server's link carries W n/S bytes and a worker's link ``per_link`` n
    (the workers sharing it), whichever is more; a server answers its W/S workers one after
    another and sums W shards of n/S bytes."""
    n = _nbytes(nbytes)
    w, s = _count("workers", workers), _count("servers", servers)
    load = max(w / s, float(per_link))
    return Terms(messages=2 * math.ceil(w / s), link_bytes=2 * load * n, reduced_bytes=w / s * n)


# ---- calibration --------------------------------------------------------------------------

class Fit(NamedTuple):
    """A calibration: the fitted machine (one link: node terms are charged to it), whether
    gamma was fitted or given, and the relative errors |predicted - measured| / measured."""
    alpha_s: float
    beta_s_per_byte: float
    gamma_s_per_byte: float
    gamma_fitted: bool
    predicted_s: Tuple[float, ...]
    median_rel_error: float
    max_rel_error: float


def one_link(terms: Terms) -> Tuple[float, float, float]:
    """(messages, bytes, reduced) with the node link merged into the link: what a measurement
    on one machine, whose ranks all talk over the same medium, can tell apart."""
    return (terms.messages + terms.node_messages, terms.link_bytes + terms.node_bytes,
            terms.reduced_bytes)


def fit(terms: Sequence[Terms], measured_s: Sequence[float],
        gamma_s_per_byte: Optional[float] = None) -> Fit:
    """alpha, beta (and gamma when ``gamma_s_per_byte`` is None) >= 0 minimising the sum of
    squared *relative* errors of the predicted times: the sizes span six decades, and an
    absolute fit would see only the largest. Relative error keeps the problem linear (log
    space would not), so model-generated times are recovered exactly. ValueError when there is
    nothing to fit or gamma cannot be told from beta (the ring's and Rabenseifner's bytes
    moved are always twice their bytes reduced)."""
    if len(terms) != len(measured_s) or not len(terms):
        raise ValueError(f"need as many terms as times, and at least one: got {len(terms)} "
                         f"terms and {len(measured_s)} times")
    y = np.asarray(measured_s, dtype=float)
    if not np.all(np.isfinite(y)) or np.any(y <= 0):
        raise ValueError(f"measured times must be finite and > 0, got {y.tolist()}")
    a = np.array([one_link(t) for t in terms], dtype=float)
    target = np.ones_like(y)
    free = [0, 1, 2]
    if gamma_s_per_byte is not None:
        target = target - a[:, 2] * gamma_s_per_byte / y
        free = [0, 1]
    scaled = a[:, free] / y[:, None]
    used = [i for i, col in zip(free, scaled.T) if np.any(col)]
    if not used:
        raise ValueError("every row costs nothing in the model (one rank?): nothing to fit")
    design = a[:, used] / y[:, None]
    if np.linalg.matrix_rank(design) < len(used):
        names = ", ".join(("alpha", "beta", "gamma")[i] for i in used)
        raise ValueError(f"{names} cannot all be told apart from these rows (bytes moved and "
                         "bytes reduced grow together); give gamma (the memory ceiling)")
    x = np.zeros(3)
    x[used] = _nonnegative_lstsq(design, target)
    if gamma_s_per_byte is not None:
        x[2] = gamma_s_per_byte
    predicted = a @ x
    rel = np.abs(predicted - y) / y
    return Fit(float(x[0]), float(x[1]), float(x[2]), gamma_s_per_byte is None,
               tuple(float(v) for v in predicted), float(np.median(rel)), float(rel.max()))


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, exactly, by trying every subset of columns (at most 3)."""
    scale = np.linalg.norm(a, axis=0)
    a = a / scale
    best, best_res = np.zeros(a.shape[1]), float(np.linalg.norm(y))
    for r in range(a.shape[1], 0, -1):
        for cols in itertools.combinations(range(a.shape[1]), r):
            x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(x < 0):
                continue
            full = np.zeros(a.shape[1])
            full[list(cols)] = x
            res = float(np.linalg.norm(a @ full - y))
            if res < best_res * (1 - 1e-12):
                best, best_res = full, res
    return best / scale


# ---- a data-parallel step -----------------------------------------------------------------

def buckets(grad_bytes, bucket_bytes) -> Tuple[float, ...]:
    """Gradient bucket sizes in the order backward fills them: full buckets, then the rest."""
    n, cap = _nbytes(grad_bytes), _nbytes(bucket_bytes)
    if cap <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes!r}")
    full, rest = divmod(n, cap)
    return (cap,) * int(full) + ((rest,) if rest else ())


def ddp_step_s(grad_bytes, compute_s: float, allreduce_s: Callable[[float], float],
               bucket_bytes=25 << 20, backward_fraction: float = 2 / 3,
               overlap: float = 1.0) -> float:
    """Seconds per data-parallel step (Note [DDP step] in docs/scale-model.md): the forward
    pass, then the backward pass producing gradient bytes at an even rate; each bucket's
    all-reduce (``allreduce_s(bytes)``) starts once it is full and the previous one is done;
    while compute runs, communication advances at ``overlap`` of its speed (1: hides fully,
    0: waits for the end of backward). The step ends when both compute and the last bucket
    are done."""
    if not compute_s > 0:
        raise ValueError(f"compute_s must be > 0, got {compute_s!r}")
    if not 0 < backward_fraction <= 1:
        raise ValueError(f"backward_fraction must be in (0, 1], got {backward_fraction!r}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    n = _nbytes(grad_bytes)
    sizes = buckets(n, bucket_bytes)
    free, left = 0.0, n
    for i, size in enumerate(sizes):
        left = left - size if i + 1 < len(sizes) else 0.0  # the last is ready at the very end
        ready = compute_s - compute_s * backward_fraction * left / n
        free = _finish(max(ready, free), allreduce_s(size), compute_s, overlap)
    return max(compute_s, free)


def _finish(start: float, work_s: float, compute_end: float, rate: float) -> float:
    """When ``work_s`` of communication started at ``start`` ends, at ``rate`` of its speed
    until ``compute_end`` and full speed after."""
    if start >= compute_end or work_s == 0:
        return start + work_s
    if rate > 0 and rate * (compute_end - start) >= work_s:
        return start + work_s / rate
    return compute_end + work_s - rate * (compute_end - start)


# ---- presets: the hardware and the models the formulas are evaluated on ---------------------

class Link(NamedTuple):
    """One kind of link: its latency and its line rate."""
    alpha_s: float        # latency of one message, software included
    bytes_per_s: float    # line rate one way (the efficiency flag scales it)


# Line rates from the standards / vendors' data sheets; latencies are typical MPI figures
# (docs/scale-model.md, "Presets"): an assumption each, a flag away from another value.
LINKS = {
    "25gbe-roce": Link(5e-6, 25e9 / 8),     # 25 Gb/s Ethernet, RoCE (TCP: 10-20 us)
    "ib-100g": Link(1.5e-6, 100e9 / 8),     # InfiniBand EDR / HDR100
    "ib-400g": Link(1.5e-6, 400e9 / 8),     # InfiniBand NDR
    "pcie3": Link(2e-6, 15.75e9),           # PCIe 3.0 x16 (Pascal-era GPU servers)
    "nvlink3": Link(1e-6, 300e9),           # A100 SXM: 600 GB/s both ways per GPU
    "nvlink4": Link(1e-6, 450e9),           # H100 SXM: 900 GB/s both ways per GPU
}
# HBM bandwidth (B/s) from NVIDIA's data sheets; a reduction reads 2 bytes and writes 1 per
# byte of output, so gamma = 3 / bandwidth
GPUS = {"p100": 732e9, "a100-80g": 2039e9, "h100": 3350e9}


class System(NamedTuple):
    """A cluster's node: its ranks, its NICs onto ``link``, what joins its ranks, its GPU."""
    link: str                  # inter-node link (one per NIC)
    per_node: int              # ranks (GPUs) per node; 0: --host-ranks-per-node
    nics: int                  # NICs per node
    node_link: Optional[str]   # None: the calibrated host's shared memory
    gpu: Optional[str]         # None: the calibrated host's gamma and mpidp's software alpha
    what: str


SYSTEMS = {
    "25gbe": System("25gbe-roce", 0, 1, None, None, "CPU hosts on 25 GbE RoCE"),
    "ib100": System("ib-100g", 0, 1, None, None, "CPU hosts on 100 Gb/s InfiniBand"),
    "ib400": System("ib-400g", 0, 1, None, None, "CPU hosts on 400 Gb/s InfiniBand"),
    "nvlink8": System("ib-400g", 8, 8, "nvlink4", "h100", "8 H100 on NVLink 4, 8 NDR NICs"),
    "horovod": System("25gbe-roce", 4, 1, "pcie3", "p100",
                      "Horovod's: 4 Pascal GPUs (PCIe assumed), 25 GbE RoCE"),
    "a100x8": System("ib-400g", 8, 8, "nvlink3", "a100-80g", "one node of 8 A100 SXM"),
    "h100x8": System("ib-400g", 8, 8, "nvlink4", "h100", "one node of 8 H100 SXM"),
}


class Model(NamedTuple):
    """A DDP preset: parameter count (fp32 gradients: 4 bytes each), compute per step."""
    params: int
    compute_s: float  # forward + backward per GPU step: 64 images / P100 images/s


# Parameters: torchvision's models (Inception V3: Keras', no auxiliary head). Compute:
# TensorFlow's benchmarks, DGX-1 (P100), synthetic data, batch 64
# (tensorflow.org/performance/benchmarks, May 2017). ResNet-101 is not in that table:
# interpolated between ResNet-50 and ResNet-152 by FLOPs (an assumption).
MODELS = {
    "resnet50": Model(25_557_032, 64 / 219),
    "resnet101": Model(44_549_160, 64 / 128.7),
    "inception3": Model(23_851_784, 64 / 142),
    "vgg16": Model(138_357_544, 64 / 154),
}
