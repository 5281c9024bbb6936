"""The doctor's probes: what each rank finds out about MPI, its place in the job, shared memory,
files left by dead jobs, one-sided communication, the all-reduce algorithms, CuPy/NCCL and
Slurm. Every rank runs every probe in the same order (several are collective); each returns a
small picklable value that rank 0 gathers and judges (mpidp.doctor.verdicts)."""
from __future__ import annotations

import functools
import importlib.util
import os
import socket
import time
import warnings

import numpy as np

from ..runtime import launcher, mpi
from ..engine.gpu.device import torch_gpu
from ..runtime.windows import Window, layout, shared_slots_sum
from . import leftovers, verdicts

ALLREDUCE_COUNTS = (5, 1 << 16)  # float32: 20 B (inline in shm) and 256 KiB (sliced)
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS",
                   "SLURM_NPROCS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_NUM_NODES",
                   "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                   "SLURM_CPUS_PER_TASK", "HYDI_CONTROL_FD", "OMPI_COMM_WORLD_SIZE",
                   "MPIR_CVAR_CH4_NETMOD")


class SkipProbe(Exception):
    """Raised by a probe that does not apply; the check is reported as SKIP."""


class Context:
    """What the probes share on one rank: COMM_WORLD and, once built, mpidp's group."""

    def __init__(self, world):
        self.world = world
        self.rank, self.size = mpi.rank_size(world)
        self.group = None
        self.group_problem = "mpidp.init() was not reached"

    def need_group(self):
        if self.group is None:
            raise SkipProbe(f"needs mpidp.init(): {self.group_problem}")
        return self.group


def _launcher_view(size: int):
    """The launcher's view, without Slurm's when this is a batch script rather than an srun
    step (a batch script sees SLURM_NTASKS=N but is one process: the Slurm check says so)."""
    view = launcher.launcher_view()
    if view is not None and view.launcher.startswith("Slurm") and \
            "SLURM_STEP_NUM_TASKS" not in os.environ:
        return None
    return view


def prints_report(size: int) -> bool:
    """Whether this process, rank 0 of its world, prints: in a job run as independent
    singletons only the launcher's rank 0 does."""
    view = _launcher_view(size)
    return size > 1 or view is None or not view.rank


# ---- MPI and the job ------------------------------------------------------------------------

def mpi_library(ctx) -> dict:
    """The MPI library, its standard, the thread level and mpi4py's version
    (mpidp.runtime.mpi.library)."""
    return mpi.library()


@functools.lru_cache(maxsize=1)
def gpu_info() -> dict:
    """CuPy, the CUDA devices and NCCL as this process sees them; never imports CuPy unless
    it is installed, never raises."""
    if importlib.util.find_spec("cupy") is None:
        return {"installed": False}
    out: dict = {"installed": True}
    try:
        import cupy
        out["version"] = cupy.__version__
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        return out
    try:
        out["devices"] = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        out["devices"], out["device_error"] = 0, f"{type(exc).__name__}: {exc}"
    try:
        from cupy.cuda import nccl
        out["nccl"] = nccl.get_version()
    except Exception as exc:
        out["nccl_error"] = f"{type(exc).__name__}: {exc}"
    return out


def ranks(ctx) -> dict:
    local_rank, local_size = mpi.node_rank(ctx.world)
    node_count = mpi.allreduce_int(ctx.world, 1 if local_rank == 0 else 0)
    view = _launcher_view(ctx.size)
    problems = launcher.disagreements(view, ctx.rank, ctx.size, local_rank, local_size)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"host": socket.gethostname(), "pid": os.getpid(), "cpus": cpus,
            "local_rank": local_rank, "local_size": local_size, "node_count": node_count,
            "launcher": view.launcher if view else None, "problems": problems,
            "singleton": verdicts.singleton_diagnosis(os.environ, ctx.size),
            "gpus": gpu_info().get("devices")}


def setup(ctx) -> dict:
    """mpidp's version, kernels and settings, then ``mpidp.init()`` (collective)."""
    import dataclasses

    import mpidp
    out: dict = {"version": mpidp.__version__, "init": None}
    try:
        from .. import config
        cfg, defaults = config.get(), config.Config()
        out["settings"] = [(f"MPIDP_{f.name.upper()}", getattr(cfg, f.name))
                           for f in dataclasses.fields(cfg)
                           if getattr(cfg, f.name) != getattr(defaults, f.name)]
    except ValueError as exc:
        out["settings"], out["config_error"] = [], str(exc)
    try:
        from ..engine import host_ops
        if "config_error" in out:  # the kernels are not chosen: is the extension built?
            problem = host_ops.BUILD_PROBLEM
            out["kernels"] = f"numpy: {problem}" if problem else "c"
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out["kernels"] = "c" if host_ops.IMPLEMENTATION == "c" else \
                    f"numpy: {host_ops._why}"
    except Exception as exc:
        out["kernels"] = f"numpy: {exc}"
    try:
        with warnings.catch_warnings():  # the doctor reports launcher problems itself
            warnings.simplefilter("ignore")
            from .. import runtime
            ctx.group = runtime.init()
    except Exception as exc:
        out["init"] = f"{type(exc).__name__}: {exc}"
    everywhere = mpi.allreduce_int(ctx.world, int(ctx.group is not None), "min")
    if not everywhere:
        ctx.group_problem = "it failed on some rank"
        ctx.group = None
    return out


# ---- communication --------------------------------------------------------------------------

def shared_memory(ctx) -> dict:
    """Every rank of a node writes its slot of an ``MPI.Win.Allocate_shared`` window and
    reads every peer's; then mpidp's shm context is built (collective)."""
    g = ctx.need_group()
    from .. import config
    got = shared_slots_sum(g.node_comm, g.local_rank, g.local_rank + 1, g.local_size)
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    return {"host": socket.gethostname(), "local_rank": g.local_rank,
            "local_size": g.local_size, "got": got,
            "expected": g.local_size * (g.local_size + 1) // 2, "mode": _shm_mode(g), "why": _shm_why(g),
            "forced": config.get().shm_peers != "auto", "dev_shm_free": free,
            "node_memory": _node_memory(g)}


def _node_memory(g) -> str:
    """How mpidp.alloc's memory is reached on this node (Note [Node heap]): "direct" where
    the peers loaded and stored this rank's block in a one-node shm all-reduce of it,
    "kernel" where they went through cross-memory attach, "wrong" for a wrong sum, "not
    offered", or "untested" (several nodes, or one rank). Collective."""
    from ..comm import collectives, node_memory
    from ..engine import host_ops
    offered = mpi.allreduce_int(g.comm, int(node_memory.offered()), "min")
    if not offered:
        return "not offered"
    if not g.single_node or g.size == 1:
        return "untested"
    x = node_memory.alloc(16384, np.float32)  # 64 KiB: above the inline size, sliced
    x[:] = g.local_rank + 1
    before = host_ops.extension().heap_stats()[1]
    collectives.allreduce_(x, algorithm="shm")
    used = host_ops.extension().heap_stats()[1] - before
    if not np.array_equal(x, np.full_like(x, g.size * (g.size + 1) // 2)):
        return "wrong"
    return "direct" if used == g.local_size - 1 else "kernel"


def _shm_mode(g) -> str:
    ctx = g.resources.shm()
    return ctx.mode_name if ctx is not None else "none (C extension missing)"


def _shm_why(g) -> str:
    ctx = g.resources.shm()
    return ctx.peers_why if ctx is not None else ""


def leftover_files(ctx):
    """Files of dead MPI jobs on this rank's node (Note [Leftover files]): {host, files:
    [(path, size_bytes, pattern)]} from the node's local rank 0, None from the other ranks
    (one scan per node). Collective over COMM_WORLD (the node split); needs no mpidp.init()."""
    local_rank, _ = mpi.node_rank(ctx.world)
    if local_rank:
        return None
    return {"host": socket.gethostname(),
            "files": [tuple(f) for f in leftovers.dead_files()]}


def one_sided(ctx) -> dict:
    """Every rank adds rank+1 to every rank's counter (Fetch_and_op) and vector
    (Accumulate) in an ``MPI.Win.Allocate`` window, as the parameter server does."""
    g = ctx.need_group()
    counter, vector, nbytes = layout((1, np.int64), (4, np.float64))
    win = Window(g.comm, nbytes)
    try:
        mpi.barrier(g.comm)  # every window zeroed before anyone adds
        for target in range(g.size):
            with win.locked(target):
                win.fetch_add(target, counter, 0, g.rank + 1)
                win.accumulate(np.full(4, g.rank + 1.0), target, vector)
        mpi.barrier(g.comm)
        with win.locked(g.rank, exclusive=True):
            got = int(win.local(counter)[0])
            vec = [float(x) for x in win.local(vector)]
    finally:
        win.free()
    return {"counter": got, "vector": vec, "expected": g.size * (g.size + 1) // 2}


def allreduce(ctx) -> list:
    """A small all-reduce with every algorithm that can run on this group, at two sizes,
    checked exactly: (algorithm, status, detail, [(bytes, seconds)]) per algorithm."""
    g = ctx.need_group()
    from .. import algorithms
    from ..comm import collectives
    from .findings import FAIL, OK, SKIP
    n = g.size
    rows = []
    for name in algorithms.NAMES[algorithms.HOST]:
        if name == "shm" and not g.single_node:
            rows.append((name, SKIP, f"needs one node; the group spans {g.node_count}", []))
            continue
        try:
            timings, wrong = [], []
            for count in ALLREDUCE_COUNTS:
                base = (np.arange(count) % 7).astype(np.float32)
                x = base + np.float32(g.rank + 1)
                best = float("inf")
                for _ in range(3):  # the first call may set things up; keep the fastest
                    t0 = time.perf_counter()
                    y = collectives.allreduce(x, "sum", name)
                    best = min(best, time.perf_counter() - t0)
                expected = base * n + np.float32(n * (n + 1) // 2)
                if not np.array_equal(y, expected):
                    wrong.append(f"{int(np.count_nonzero(y != expected))} of {count} "
                                 f"elements wrong at {count * 4} B")
                timings.append((count * 4, best))
            auto = algorithms.choose(algorithms.HOST, "auto", g.resources.facts, count * 4)
            detail = f"; auto picks {auto.name}" \
                if name == "auto" else ""
            rows.append((name, FAIL, "; ".join(wrong), timings) if wrong else
                        (name, OK, detail, timings))
        except Exception as exc:
            rows.append((name, FAIL, f"{type(exc).__name__}: {exc}", []))
    return rows


# ---- GPU and Slurm --------------------------------------------------------------------------

def gpu(ctx) -> dict:
    info = dict(gpu_info())
    g = ctx.group
    info["torch_gpus"], info["torch_gpu_id"] = _torch_gpu(g.local_rank if g is not None else 0)
    info["local_size"] = g.local_size if g is not None else 1
    info["host"] = socket.gethostname()
    if info.get("devices") and g is not None:
        try:
            import cupy
            props = cupy.cuda.runtime.getDeviceProperties(g.local_rank % info["devices"])
            name = props["name"]
            info["name"] = name.decode() if isinstance(name, bytes) else str(name)
        except Exception as exc:
            info["name"] = f"? ({type(exc).__name__})"
    return info


def _torch_gpu(local_rank: int) -> tuple:
    """What the training tool's --device auto looks at: the GPUs torch sees here and the
    identity of the one this rank is bound to ((0, None) without torch or CUDA)."""
    if importlib.util.find_spec("torch") is None:
        return 0, None
    return torch_gpu(local_rank)


def slurm(ctx) -> dict:
    return {"rank": ctx.rank, "size": ctx.size,
            "env": {k: os.environ[k] for k in SLURM_VARIABLES if k in os.environ}}
