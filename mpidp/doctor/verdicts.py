"""The doctor's verdicts: one pure function per check, from what every rank found (one value
per rank, gathered on rank 0) to findings, each problem with its fix."""
from __future__ import annotations

import shlex
from typing import Mapping, Optional

from ..engine.gpu.device import training_device
from ..runtime.launcher import singleton_launch
from .findings import FAIL, INFO, OK, SKIP, WARN, Finding, by_value, rank_list
from .leftovers import globs

ONE_LINE_PER_RANK = 16  # larger jobs get one line per host in the rank map


# ---- MPI ------------------------------------------------------------------------------------

THREAD_NAMES = ("SINGLE", "FUNNELED", "SERIALIZED", "MULTIPLE")


# what the library's fault tolerance means for a lost rank (docs/recovery.md)
FAULT_TOLERANCE = {
    "on": "fault tolerance (ULFM) on in this job: a lost rank is replaced inside the job "
          "(MPIDP_RECOVERY)",
    "offered": "fault tolerance (ULFM) offered but off in this job: launch with `mpiexec "
               "--with-ft ulfm` for in-job recovery (docs/recovery.md)",
    "none": "no fault tolerance in this MPI: a lost rank ends the job, and python -m "
            "mpidp.run relaunches it; in-job recovery needs Open MPI (docs/recovery.md)"}


def verdict_mpi(values: list) -> list:
    """values: {library, standard (major, minor), thread (0 SINGLE .. 3 MULTIPLE), mpi4py}."""
    v0 = values[0]
    libraries = by_value(values, lambda v: v["library"])
    out = [Finding(INFO, f"{v0['library']} (MPI standard {v0['standard'][0]}."
                         f"{v0['standard'][1]}), mpi4py {v0['mpi4py']}")]
    if len(libraries) > 1:
        out.append(Finding(FAIL, "ranks run different MPI libraries: " + "; ".join(
            f"{rank_list(rs)}: {lib}" for lib, rs in libraries.items()),
            "install one MPI for the whole job (one virtual environment on a shared file "
            "system, or the same site MPI on every node)"))
    else:
        out.append(Finding(OK, "the same MPI library on every rank"))
    levels = by_value(values, lambda v: v["thread"])
    worst = min(levels)
    name = THREAD_NAMES[worst] if 0 <= worst < 4 else str(worst)
    where = "" if len(levels) == 1 else f" on {rank_list(levels[worst])}"
    fix = ("let mpidp.init() start MPI (it asks for MULTIPLE), or call "
           "MPI.Init_thread(MPI.THREAD_MULTIPLE) yourself before anything else initialises it")
    if worst >= 3:
        out.append(Finding(OK, "thread level MULTIPLE (mpidp.init asks for MULTIPLE)"))
    elif worst == 2:
        out.append(Finding(WARN, f"thread level SERIALIZED{where}: DDP works (its "
                                 "communication thread needs SERIALIZED), MULTIPLE was asked "
                                 "for", fix))
    else:
        out.append(Finding(FAIL, f"thread level {name}{where}: DistributedDataParallel "
                                 "needs SERIALIZED or better", fix))
    out.append(Finding(INFO, FAULT_TOLERANCE[v0.get("fault_tolerance", "none")]))
    return out


# ---- ranks, hosts, launchers ----------------------------------------------------------------

def singleton_diagnosis(env: Mapping[str, str], mpi_size: int) -> Optional[Finding]:
    """A FAIL when a launcher started several processes but MPI sees a world of one in this
    one (mpidp.runtime.launcher.singleton_launch); None otherwise."""
    found = singleton_launch(mpi_size, env)
    return None if found is None else Finding(FAIL, found[0], found[1])


def rank_map(values: list) -> list:
    """Plain lines: rank -> host -> local rank (-> GPU), one per rank, or one per host
    beyond ONE_LINE_PER_RANK ranks."""
    lines = []
    if len(values) <= ONE_LINE_PER_RANK:
        for r, v in enumerate(values):
            gpu = f"  gpu {v['local_rank'] % v['gpus']}" if v.get("gpus") else ""
            lines.append(Finding(INFO, f"rank {r:<3} {v['host']:<20} local {v['local_rank']}/"
                                       f"{v['local_size']}  pid {v['pid']:<7} cpus "
                                       f"{v['cpus']}{gpu}"))
        return lines
    for host, rs in by_value(values, lambda v: v["host"]).items():
        gpus = values[rs[0]].get("gpus")
        lines.append(Finding(INFO, f"{host:<20} {rank_list(rs)} ({len(rs)} ranks"
                                   + (f", {gpus} GPUs" if gpus else "") + ")"))
    return lines


def verdict_ranks(values: list) -> list:
    """values: {host, pid, cpus, local_rank, local_size, node_count, launcher (name or None),
    problems (launcher.disagreements on that rank), singleton (a Finding or None), gpus}."""
    out = rank_map(values)
    singletons = [v["singleton"] for v in values if v.get("singleton")]
    if singletons:
        return out + [singletons[0]]
    per_rank = {r: v["problems"] for r, v in enumerate(values) if v["problems"]}
    if per_rank:
        for r, ps in list(per_rank.items())[:4]:
            out.append(Finding(FAIL, f"rank {r}: " + "; ".join(ps),
                               "launch with the mpiexec of the MPI library mpi4py uses, and do "
                               "not set rank variables by hand"))
        if len(per_rank) > 4:
            out.append(Finding(FAIL, f"... and {len(per_rank) - 4} more ranks disagree"))
    else:
        names = sorted({v["launcher"] or "none" for v in values})
        text = "launcher variables agree with MPI on every rank" if names != ["none"] else \
            "no launcher variables (a plain python process or an unknown launcher)"
        out.append(Finding(OK, f"{text} ({', '.join(names)})" if names != ["none"] else text))
    hosts = len({v["host"] for v in values})
    nodes = values[0]["node_count"]
    if hosts != nodes:
        out.append(Finding(WARN, f"{hosts} host names but {nodes} shared-memory nodes "
                                 "(MPI_COMM_TYPE_SHARED): host names do not identify nodes "
                                 "here (containers?)",
                           "harmless for correctness; mpidp follows MPI's nodes"))
    else:
        out.append(Finding(OK, f"{len(values)} rank(s) on {nodes} node(s): " + ", ".join(
            f"{len(rs)}" for rs in by_value(values, lambda v: v["host"]).values())
            + " per node"))
    return out


# ---- mpidp ----------------------------------------------------------------------------------

def verdict_mpidp(values: list) -> list:
    """values: {version, kernels ("c" or "numpy: why"), settings ([(name, value)] differing
    from the defaults), config_error (a bad MPIDP_* value, if any), init (None or the
    error)}."""
    v0 = values[0]
    out = [Finding(INFO, f"mpidp {v0['version']}")]
    numpy_twin = [r for r, v in enumerate(values) if v["kernels"] != "c"]
    if numpy_twin:
        out.append(Finding(WARN, f"{rank_list(numpy_twin)}: the C extension is not built, "
                                 f"the numpy twin runs ({values[numpy_twin[0]]['kernels']})",
                           "reinstall with a C compiler present: pip install -e . "
                           "(or pip install --force-reinstall mpidp)"))
    else:
        out.append(Finding(OK, "C extension loaded (shared-memory protocol, kernels, fusion)"))
    settings = by_value([v for v in values if not v.get("config_error")],
                        lambda v: tuple(v["settings"]))
    for s, rs in settings.items():
        where = "" if len(settings) == 1 else f" on {rank_list(rs)}"
        out.append(Finding(INFO, f"settings{where}: " + (", ".join(f"{k}={x}" for k, x in s)
                                                          or "all defaults")))
    if len(settings) > 1:
        out.append(Finding(WARN, "ranks run with different MPIDP_* settings",
                           "export the same MPIDP_* variables to every rank (mpiexec -genv, "
                           "or srun --export=ALL)"))
    bad = by_value(values, lambda v: v.get("config_error"))
    bad.pop(None, None)
    for err, rs in bad.items():
        out.append(Finding(FAIL, f"{rank_list(rs)}: {err}",
                           "correct that variable or unset it (docs/configuration.md)"))
    failed = by_value(values, lambda v: v["init"])
    failed.pop(None, None)
    for err, rs in failed.items():
        if any(e in err for e in bad):
            continue  # the settings' error, named above
        if err.startswith("LaunchError"):  # independent singletons, named under Ranks
            out.append(Finding(SKIP, "mpidp.init() refuses this launch (see Ranks)"))
            continue
        out.append(Finding(FAIL, f"mpidp.init() failed on {rank_list(rs)}: {err}",
                           "the message names the cause; the checks below need mpidp.init"))
    if not failed:
        out.append(Finding(OK, "mpidp.init(): group built on every rank"))
    return out


# ---- shared memory, one-sided, all-reduce ---------------------------------------------------

DEV_SHM_MIN_BYTES = 512 << 20


def verdict_shm(values: list) -> list:
    """values: {host, local_rank, local_size, got, expected (the Allocate_shared sum), mode
    ("cma" or "window"), why (how it was chosen; optional), forced (MPIDP_SHM_PEERS was not
    auto), dev_shm_free (bytes or None)}."""
    out = []
    wrong = [r for r, v in enumerate(values) if v["got"] != v["expected"]]
    if wrong:
        v = values[wrong[0]]
        out.append(Finding(FAIL, f"Win.Allocate_shared: {rank_list(wrong)} read wrong values "
                                 f"from their node's peers (got {v['got']}, expected "
                                 f"{v['expected']})",
                           "MPI's shared memory is broken here: check that /dev/shm is mounted "
                           "and writable; meanwhile MPIDP_ALGORITHM=mpi avoids mpidp's shm"))
    else:
        out.append(Finding(OK, "Win.Allocate_shared: every rank reads its node's peers"))
    if all(v["local_size"] == 1 for v in values):
        out.append(Finding(OK, "one rank per node: the shm all-reduce has nothing to share"))
    elif all(v["mode"] == "cma" for v in values):
        why = values[0].get("why")
        out.append(Finding(OK, "shm all-reduce: single copy through cross-memory attach "
                               f"(process_vm_readv){f'; {why}' if why else ''}"))
    elif all(v["forced"] for v in values):
        out.append(Finding(OK, "shm all-reduce: staging window (MPIDP_SHM_PEERS=window)"))
    else:
        why = next((v["why"] for v in values if v.get("why") and v["mode"] != "cma"), None)
        out.append(Finding(WARN, "shm all-reduce: process_vm_readv is blocked between the "
                                 "ranks (ptrace restricted), so buffers are staged through a "
                                 f"shared window: correct, slower for large buffers"
                                 f"{f' ({why})' if why else ''}",
                           "under Yama ptrace_scope 1 mpidp allows only the local ranks' common "
                           "parent (the launcher's proxy) to attach, so start every rank of a "
                           "node from one launcher; else allow it: sysctl "
                           "kernel.yama.ptrace_scope=0, or run the container with "
                           "--cap-add=SYS_PTRACE (or set MPIDP_SHM_PEERS=window to accept "
                           "staging)"))
    out += _verdict_node_memory(values)
    small = by_value([v for v in values if v["dev_shm_free"] is not None
                      and v["dev_shm_free"] < DEV_SHM_MIN_BYTES], lambda v: v["host"])
    for host in small:
        free = next(v["dev_shm_free"] for v in values if v["host"] == host)
        out.append(Finding(WARN, f"{host}: /dev/shm has only {free >> 20} MiB free; MPI's "
                                 "shared memory and mpidp's staging windows live there",
                           "give it more: docker run --shm-size=2g (or remount /dev/shm "
                           "larger)"))
    return out


def _verdict_node_memory(values: list) -> list:
    """values' "node_memory" (probes._node_memory): one finding, none where not probed."""
    seen = {v.get("node_memory") for v in values} - {None}
    if seen == {"direct"}:
        return [Finding(OK, "node memory (mpidp.alloc): the node's ranks load and store "
                            "each other's blocks directly")]
    if seen == {"not offered"}:
        return [Finding(OK, "node memory (mpidp.alloc): not offered here (no C extension, Yama "
                            "restricting ptrace, or window peers): ordinary arrays")]
    wrong = [r for r, v in enumerate(values) if v.get("node_memory") == "wrong"]
    if wrong:
        return [Finding(FAIL, f"node memory (mpidp.alloc): {rank_list(wrong)} got a wrong "
                              "all-reduce of it", "report it; meanwhile all-reduce ordinary "
                                                   "arrays")]
    if "kernel" in seen:
        return [Finding(WARN, "node memory (mpidp.alloc): offered, but the peers could not "
                              "map it (/proc/<pid>/fd): its all-reduces go through "
                              "cross-memory attach, correct and slower",
                        "check that /proc is mounted without hidepid and that the ranks run "
                        "as one user")]
    return []


FIX_NAMES = 3  # leftover files named in the rm command; the rest are counted


def _bytes_text(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else _size_text(nbytes)


def verdict_leftovers(values: list) -> list:
    """values: per rank None, or from each node's local rank 0 {host, files: [(path,
    size_bytes, pattern)]}: files this user owns that no process of theirs holds
    (Note [Leftover files] in mpidp.doctor.leftovers). The fix names at most FIX_NAMES of
    them and how to list the rest; the doctor never deletes."""
    nodes = [v for v in values if v is not None]
    dirty = [v for v in nodes if v["files"]]
    if not dirty:
        where = f" on any of the {len(nodes)} nodes" if len(nodes) > 1 else ""
        return [Finding(OK, f"no files left by dead MPI jobs{where} ({globs()})")]
    out = []
    for v in dirty:
        files = v["files"]
        total = sum(size for _, size, _ in files)
        kinds = ", ".join(f"{len(indices)} {pattern}" for pattern, indices in
                          by_value(files, lambda f: f[2]).items())
        named = " ".join(shlex.quote(path) for path, _, _ in files[:FIX_NAMES])
        rest = len(files) - FIX_NAMES
        fix = f"rm {named}" + (f"; the other {rest}: python -m mpidp.doctor --leftovers | "
                               "xargs rm" if rest > 0 else "")
        if len(nodes) > 1:
            fix = f"on {v['host']}: {fix}"
        out.append(Finding(WARN, f"{v['host']}: {len(files)} file(s) left by dead MPI jobs "
                                 f"(an abort or a killed rank), {_bytes_text(total)} in all: "
                                 f"{kinds}; no process of yours holds them", fix))
    return out


def verdict_rma(values: list) -> list:
    """values: {counter, vector (list), expected}."""
    wrong = [r for r, v in enumerate(values)
             if v["counter"] != v["expected"] or any(x != v["expected"] for x in v["vector"])]
    if wrong:
        v = values[wrong[0]]
        return [Finding(FAIL, f"{rank_list(wrong)}: after every rank's Fetch_and_op and "
                              f"Accumulate the window holds {v['counter']} and {v['vector']}, "
                              f"expected {v['expected']}",
                        "MPI one-sided communication is broken on this fabric: the parameter "
                        "server needs it (try another MPI library or network provider)")]
    return [Finding(OK, f"Win.Allocate, Fetch_and_op and Accumulate from every rank to every "
                        f"rank: exact ({len(values)} x {len(values)})")]


def _size_text(nbytes: int) -> str:
    return f"{nbytes >> 10} KiB" if nbytes >= 1024 else f"{nbytes} B"


def verdict_allreduce(values: list) -> list:
    """values: per rank a list of (algorithm, status, detail, [(bytes, seconds), ...]) in the
    same order on every rank; a row's worst status over the ranks wins."""
    out = []
    order = {OK: 0, SKIP: 1, WARN: 2, FAIL: 3}
    for rows in zip(*values):
        name = rows[0][0]
        worst = max(rows, key=lambda row: order[row[1]])
        if worst[1] != OK:
            bad = [r for r, row in enumerate(rows) if row[1] == worst[1]]
            where = f"{rank_list(bad)}: " if worst[1] == FAIL and len(bad) < len(rows) else ""
            fix = "" if worst[1] == SKIP else (
                f"algorithm={name!r} gives wrong sums or fails here; the message names the "
                "cause (MPIDP_ALGORITHM picks another for 'auto' meanwhile)")
            out.append(Finding(worst[1], f"{name:<5} {where}{worst[2]}", fix))
            continue
        times = [max(row[3][k][1] for row in rows) for k in range(len(worst[3]))]
        sizes = " and ".join(_size_text(b) for b, _ in worst[3])
        took = ", ".join(f"{t * 1e6:.0f} µs" for t in times)
        out.append(Finding(OK, f"{name:<5} exact at {sizes} ({took}){worst[2]}"))
    return out


# ---- GPU and Slurm --------------------------------------------------------------------------

def verdict_gpu(values: list) -> list:
    """values: {installed, version, error, devices, device_error, nccl, nccl_error, name,
    local_size, host}."""
    v0 = values[0]
    kind, why = training_device("auto", [v.get("torch_gpus", 0) for v in values],
                                [v.get("torch_gpu_id") for v in values])
    out = [Finding(INFO, f"python -m mpidp.train --device auto: {kind} ({why}; the parameter "
                         "server and central train on the CPU)")]
    if not any(v["installed"] for v in values):
        return out + [Finding(SKIP, "CuPy not installed: CPU only",
                              "for GPU training: pip install 'mpidp[gpu]'")]
    broken = by_value([v.get("error") for v in values])
    broken.pop(None, None)
    for err, rs in broken.items():
        out.append(Finding(FAIL, f"{rank_list(rs)}: import cupy failed: {err}",
                           "reinstall CuPy for this CUDA: pip install 'mpidp[gpu]' "
                           "(cupy-cuda12x needs an NVIDIA driver for CUDA 12)"))
    if broken:
        return out
    out.append(Finding(INFO, f"CuPy {v0['version']}"))
    none = [r for r, v in enumerate(values) if not v.get("devices")]
    if none:
        why = values[none[0]].get("device_error") or "0 devices"
        out.append(Finding(WARN, f"{rank_list(none)}: no CUDA device visible ({why})",
                           "check nvidia-smi on that host, CUDA_VISIBLE_DEVICES and the job's "
                           "GPU request (srun --gpus-per-task=1)"))
    else:
        names = sorted({v.get("name") or "?" for v in values})
        out.append(Finding(OK, f"CUDA devices: {', '.join(names)}; rank r uses device "
                               "local_rank % devices"))
        shared = by_value([v for v in values if v["local_size"] > v["devices"]],
                          lambda v: v["host"])
        for host in shared:
            v = next(x for x in values if x["host"] == host)
            out.append(Finding(WARN, f"{host}: {v['local_size']} ranks share {v['devices']} "
                                     "GPU(s)",
                               "launch one rank per GPU (mpiexec -n <GPUs per node x nodes>, "
                               "or srun --ntasks-per-node=<GPUs per node>)"))
    nccl = by_value([v.get("nccl_error") for v in values])
    nccl.pop(None, None)
    if nccl:
        err, rs = next(iter(nccl.items()))
        out.append(Finding(WARN, f"{rank_list(rs)}: NCCL unavailable to CuPy ({err})",
                           "pip install nvidia-nccl-cu12 (CuPy loads libnccl at run time)"))
    elif v0.get("nccl"):
        out.append(Finding(OK, f"NCCL {v0['nccl']} through cupy.cuda.nccl"))
    return out


def verdict_slurm(values: list) -> list:
    """values: {rank, size, env (the SLURM_* and launcher variables that matter)}."""
    envs = [v["env"] for v in values]
    e0 = envs[0]
    if not any(e.get("SLURM_JOB_ID") for e in envs):
        return [Finding(SKIP, "not inside a Slurm job (SLURM_JOB_ID unset)")]
    size = values[0]["size"]
    job = e0.get("SLURM_JOB_ID")
    allocated = e0.get("SLURM_NTASKS") or e0.get("SLURM_NPROCS")
    nodes = e0.get("SLURM_JOB_NUM_NODES") or e0.get("SLURM_NNODES") or "?"
    out = [Finding(INFO, f"job {job}: {allocated or '?'} task(s) on {nodes} node(s) "
                         f"({e0.get('SLURM_JOB_NODELIST') or e0.get('SLURM_NODELIST') or '?'})")]
    by_mpiexec = any(e.get("HYDI_CONTROL_FD") or e.get("OMPI_COMM_WORLD_SIZE") for e in envs)
    step_tasks = e0.get("SLURM_STEP_NUM_TASKS")
    if by_mpiexec:
        out.append(Finding(OK, f"launched by mpiexec inside the allocation: {size} MPI ranks"))
        if allocated and allocated.isdigit() and size > int(allocated):
            out.append(Finding(WARN, f"{size} ranks but the allocation has {allocated} "
                                     "tasks: the nodes are oversubscribed",
                               f"sbatch -n {size} (or --ntasks-per-node), or mpiexec -n "
                               f"{allocated}"))
        return out
    if step_tasks is None:
        out.append(Finding(WARN, f"running in the batch script itself: one process of a "
                                 f"{allocated or '?'}-task allocation",
                           "launch the job with srun --mpi=pmi2 or mpiexec inside the script"))
        return out
    if size == 1 and step_tasks.isdigit() and int(step_tasks) > 1:
        return out + [Finding(INFO, f"srun started {step_tasks} tasks but MPI sees a world "
                                    "of 1 in each: the singletons named under Ranks")]
    wrong = [v["rank"] for v in values if v["env"].get("SLURM_PROCID") != str(v["rank"])]
    if step_tasks != str(size) or wrong:
        return out + [Finding(FAIL, f"srun step of {step_tasks} tasks, MPI has {size} ranks"
                                    + (f"; SLURM_PROCID differs from the MPI rank on "
                                       f"{rank_list(wrong)}" if wrong else ""),
                              "launch exactly one MPI rank per srun task: srun --mpi=pmi2 -n "
                              "N python -m ...")]
    out.append(Finding(OK, f"srun step {job}.{e0.get('SLURM_STEP_ID', '?')}: {size} tasks "
                           "= MPI ranks, SLURM_PROCID = rank on every rank"))
    if e0.get("MPIR_CVAR_CH4_NETMOD"):  # Note [PMI-1 lines under srun] in mpidp/runtime/launcher.py
        out.append(Finding(INFO, f"MPICH netmod {e0['MPIR_CVAR_CH4_NETMOD']} "
                                 "(MPIR_CVAR_CH4_NETMOD)"))
    return out
