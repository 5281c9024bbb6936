"""The HOROVOD_* variables a Horovod user may have set, read by ``hvd.init``: each one Horovod
reads at run time is mapped to mpidp's setting, accepted where it changes nothing mpidp does,
or refused in one line naming what mpidp has instead (docs/horovod.md). Horovod's build-time
variables (HOROVOD_WITH_*, HOROVOD_GPU_*, ..., often left in a shell's profile after ``pip
install horovod``) mean nothing at run time and are ignored. mpidp.init reads them in its
agreement of the ranks' settings, so a refusal is raised on every rank."""
from __future__ import annotations

import os
from typing import Mapping

from ..errors import ConfigError

NO_CYCLE = "mpidp has no background cycle: each collective starts when it is called"
WATCHDOG = ("mpidp's watchdog ends a stalled job after MPIDP_TIMEOUT_S seconds (default 180), "
            "naming the late ranks")
CONFIGURATION = "mpidp's settings are MPIDP_* variables (docs/configuration.md)"

# Horovod's run-time variables that mpidp refuses, with what it has instead
REFUSED = {
    "HOROVOD_CYCLE_TIME": NO_CYCLE,
    "HOROVOD_TIMELINE_MARK_CYCLES": NO_CYCLE,
    "HOROVOD_STALL_CHECK_TIME_SECONDS": WATCHDOG,
    "HOROVOD_STALL_CHECK_DISABLE": WATCHDOG,
    "HOROVOD_AUTOTUNE": "mpidp chooses its algorithm by message size and node layout "
                        "(MPIDP_ALGORITHM=auto; `python -m mpidp.bench` measures them)",
    "HOROVOD_AUTOTUNE_LOG": "mpidp has no autotuner (MPIDP_ALGORITHM=auto)",
    "HOROVOD_CACHE_CAPACITY": "mpidp has no response cache: ranks match calls by their order",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "mpidp's all-gather is MPI's",
    "HOROVOD_ELASTIC": "mpidp resumes a checkpoint on any number of ranks instead "
                       "(docs/operations.md)",
    "HOROVOD_MPI_THREADS_DISABLE": "mpidp needs MPI's thread level MULTIPLE",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "Adasum is refused (use hvd.Average)",
}
# Horovod's run-time variables that change nothing mpidp does (logging, thread pinning,
# NCCL streams, NVTX, XLA, gloo's interface): accepted and ignored
NO_EFFECT = ("HOROVOD_LOG_LEVEL", "HOROVOD_LOG_HIDE_TIME", "HOROVOD_THREAD_AFFINITY",
             "HOROVOD_NUM_NCCL_STREAMS", "HOROVOD_DISABLE_NVTX_RANGES", "HOROVOD_ENABLE_XLA_OPS",
             "HOROVOD_ENABLE_ASYNC_COMPLETION", "HOROVOD_GLOO_IFACE",
             "HOROVOD_GLOO_TIMEOUT_SECONDS")
# prefixes of the variables Horovod's build reads (setup.py, CMake), not its run time
BUILD_TIME = ("HOROVOD_WITH", "HOROVOD_WITHOUT", "HOROVOD_GPU", "HOROVOD_CPU_OPERATIONS",
              "HOROVOD_CUDA", "HOROVOD_ROCM", "HOROVOD_NCCL", "HOROVOD_BUILD",
              "HOROVOD_CMAKE", "HOROVOD_DEBUG", "HOROVOD_ALLOW_MIXED_GPU_IMPL",
              "HOROVOD_MPICXX_SHOW", "HOROVOD_CCL")


def _fusion(value: str) -> dict:
    try:
        n = int(value)
    except ValueError:
        raise ConfigError("HOROVOD_FUSION_THRESHOLD", value, "expected bytes, an integer >= 0") \
            from None
    if n < 0:
        raise ConfigError("HOROVOD_FUSION_THRESHOLD", value, "expected bytes, an integer >= 0")
    return {"MPIDP_HOROVOD_FUSION_BYTES": str(max(n, 1))}  # 0, Horovod's "no fusion": 1 B


def _timeline(value: str) -> dict:
    if value.strip().upper() == "DYNAMIC":  # Horovod's "none until hvd.start_timeline"
        return {}
    return {"MPIDP_TIMELINE": value}


def _stall_shutdown(value: str) -> dict:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds == 0:  # Horovod's default, "never": mpidp's watchdog keeps MPIDP_TIMEOUT_S
        return {}
    if not 0 < seconds < float("inf"):
        raise ConfigError("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", value,
                          f"expected seconds >= 0: {WATCHDOG}")
    return {"MPIDP_TIMEOUT_S": value}


MAPPED = {"HOROVOD_FUSION_THRESHOLD": _fusion, "HOROVOD_TIMELINE": _timeline,
          "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": _stall_shutdown,
          # auto already takes the hierarchical all-reduce across nodes where it pays
          "HOROVOD_HIERARCHICAL_ALLREDUCE": lambda value: {},
          "HOROVOD_DYNAMIC_PROCESS_SETS": lambda value: {}}  # sets may always be added


def mapped(env: Mapping[str, str] | None = None) -> dict:
    """The ``MPIDP_*`` settings that ``env``'s (default: os.environ's) HOROVOD_* variables map
    to; ConfigError, one line, for the first one refused, in name order."""
    env = os.environ if env is None else env
    out: dict = {}
    for name in sorted(k for k in env if k.startswith("HOROVOD_")):
        if name in MAPPED:
            out.update(MAPPED[name](env[name]))
        elif not name.startswith(BUILD_TIME) and name not in NO_EFFECT:
            raise ConfigError(name, env[name], "not supported by mpidp.horovod: "
                              + REFUSED.get(name, CONFIGURATION))
    return out
