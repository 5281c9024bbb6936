"""The one reader of ``MPIDP_*`` environment variables: every tunable and its default.

Note [Settings read at init]
The settings are read on first use — ``mpidp.init()``, which reads them before anything
else, or a kernel used before it — never when a module is imported: a bad value is then one
ConfigError (a ValueError naming the variable, its value and what is accepted) raised by
``mpidp.init()`` on every rank, which the command-line tools turn into one line and exit
code 2, instead of a traceback from ``import mpidp`` on every rank. A module that needs a
setting on its hot path takes it at init (the timeline's ``ON``: Note [Timeline cost] in
mpidp/runtime/timeline.py) or on first use (the host kernels: mpidp/engine/host_ops.py)."""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Mapping

from .algorithms import HOST, NAMES
from .errors import ConfigError

ALGORITHMS = NAMES[HOST]
SHM_PEER_MODES = ("auto", "cma", "window")
AUDIT_ACTIONS = ("raise", "warn")
RECOVERY_MODES = ("auto", "respawn", "shrink", "off")  # Note [In-job recovery]
PS_MEMORIES = ("auto", "window")  # Note [Node-local shards] in mpidp/modes/ps_shared.py
# the control block's inline payload: csrc/shm.h's SHM_INLINE_BYTES (mpidp._ext exports it; a
# test compares them)
SHM_INLINE_MAX_BYTES = 4096
BOOL_SPELLINGS = ("1", "0", "true", "false", "yes", "no", "on", "off")  # any case; "" is off


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings read once from the environment (docs/configuration.md)."""

    algorithm: str = "auto"            # MPIDP_ALGORITHM: default for algorithm="auto"
    ring_piece_bytes: int = 1 << 20    # MPIDP_RING_PIECE_BYTES: pipelining unit of the ring
    shm_chunk_bytes: int = 256 << 10   # MPIDP_SHM_CHUNK_BYTES: Note [Chunk size], csrc/shm.c
    shm_inline_bytes: int = 4096       # MPIDP_SHM_INLINE_BYTES: carried in the control block
    shm_peers: str = "auto"            # MPIDP_SHM_PEERS: auto | cma | window
    hier_min_bytes: int = 64 << 10     # MPIDP_HIER_MIN_BYTES: from it, auto uses hier across nodes
    doubling_max_bytes: int = 64 << 10  # MPIDP_DOUBLING_MAX_BYTES: below it, auto uses doubling
    emulate_node_size: int = 0         # MPIDP_EMULATE_NODE_SIZE: k > 0 treats k ranks as a node
    timeout_s: float = 180.0           # MPIDP_TIMEOUT_S: Note [Watchdog] in mpidp/runtime/watchdog.py
    debug: bool = False                # MPIDP_DEBUG: fingerprint every collective (handshake.py)
    abort_on_exception: bool = True    # MPIDP_ABORT_ON_EXCEPTION: abort the job on any rank's error
    require_extension: bool = False    # MPIDP_REQUIRE_EXTENSION (default: on when CI is set)
    extension: bool = True             # MPIDP_EXTENSION: 0 runs without the C extension (tests)
    timeline: str = ""                 # MPIDP_TIMELINE: a Chrome-trace JSON file ("": off)
    audit_every: int = 0               # MPIDP_AUDIT_EVERY: DDP's replica audit (0: off)
    audit_action: str = "raise"        # MPIDP_AUDIT_ACTION: raise | warn (Note [Replica audit])
    horovod_fusion_bytes: int = 128 << 20  # MPIDP_HOROVOD_FUSION_BYTES: hvd's fused buckets
    recovery: str = "auto"             # MPIDP_RECOVERY: auto | respawn | shrink | off (recovery.py)
    ps_memory: str = "auto"            # MPIDP_PS_MEMORY: auto | window (Note [Node-local shards])


# settings of the algorithms that must be the same on every rank (compared by mpidp.init):
# ranks that disagree would move data differently, pair the wrong calls or hang
AGREED = ("algorithm", "ring_piece_bytes", "shm_chunk_bytes", "shm_inline_bytes", "shm_peers",
          "hier_min_bytes", "doubling_max_bytes", "emulate_node_size", "debug", "extension", "timeline",
          "audit_every", "audit_action", "horovod_fusion_bytes", "recovery", "ps_memory")


def agreed(cfg: Config) -> tuple:
    """The values of ``cfg``'s AGREED settings (of the timeline: whether it is on; each rank
    may name its own file)."""
    return tuple(bool(cfg.timeline) if name == "timeline" else getattr(cfg, name)
                 for name in AGREED)


def env_name(field: str) -> str:
    """The environment variable that sets Config field ``field``."""
    return "MPIDP_" + field.upper()


def _parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(name, text, f"expected one of {', '.join(BOOL_SPELLINGS)}")


def _parse_int(name: str, text: str, minimum: int, maximum: int | None = None) -> int:
    accepted = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(name, text, f"expected an integer {accepted}") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise ConfigError(name, text, f"must be {accepted}"
                          + (" (the control block's size)" if maximum is not None else ""))
    return value


def _parse_choice(name: str, text: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise ConfigError(name, text, f"expected one of {', '.join(choices)}")
    return text


def _parse_seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(name, text, "expected seconds > 0 (a number)") from None
    if not 0 < value < float("inf"):
        raise ConfigError(name, text, "must be > 0 and finite")
    return value


def _timeline(env: Mapping[str, str]) -> str:
    return env.get("MPIDP_TIMELINE", "").strip()


def from_env(env: Mapping[str, str] | None = None) -> Config:
    """Builds a Config from ``env`` (default ``os.environ``); a bad value raises ConfigError
    (a ValueError) naming the variable, its value and what is accepted."""
    env = os.environ if env is None else env
    kw: dict = {}
    get = env.get
    if (v := get("MPIDP_ALGORITHM")) is not None:
        kw["algorithm"] = _parse_choice("MPIDP_ALGORITHM", v, ALGORITHMS)
    if (v := get("MPIDP_RING_PIECE_BYTES")) is not None:
        kw["ring_piece_bytes"] = _parse_int("MPIDP_RING_PIECE_BYTES", v, 64)
    if (v := get("MPIDP_SHM_CHUNK_BYTES")) is not None:
        kw["shm_chunk_bytes"] = _parse_int("MPIDP_SHM_CHUNK_BYTES", v, 64)
    if (v := get("MPIDP_SHM_INLINE_BYTES")) is not None:
        kw["shm_inline_bytes"] = _parse_int("MPIDP_SHM_INLINE_BYTES", v, 0, SHM_INLINE_MAX_BYTES)
    if (v := get("MPIDP_SHM_PEERS")) is not None:
        kw["shm_peers"] = _parse_choice("MPIDP_SHM_PEERS", v, SHM_PEER_MODES)
    if (v := get("MPIDP_HIER_MIN_BYTES")) is not None:
        kw["hier_min_bytes"] = _parse_int("MPIDP_HIER_MIN_BYTES", v, 0)
    if (v := get("MPIDP_DOUBLING_MAX_BYTES")) is not None:
        kw["doubling_max_bytes"] = _parse_int("MPIDP_DOUBLING_MAX_BYTES", v, 0)
    if (v := get("MPIDP_EMULATE_NODE_SIZE")) is not None:
        kw["emulate_node_size"] = _parse_int("MPIDP_EMULATE_NODE_SIZE", v, 0)
    if (v := get("MPIDP_TIMEOUT_S")) is not None:
        kw["timeout_s"] = _parse_seconds("MPIDP_TIMEOUT_S", v)
    if (v := get("MPIDP_DEBUG")) is not None:
        kw["debug"] = _parse_bool("MPIDP_DEBUG", v)
    if (v := get("MPIDP_ABORT_ON_EXCEPTION")) is not None:
        kw["abort_on_exception"] = _parse_bool("MPIDP_ABORT_ON_EXCEPTION", v)
    kw["timeline"] = _timeline(env)
    if (v := get("MPIDP_AUDIT_EVERY")) is not None:
        kw["audit_every"] = _parse_int("MPIDP_AUDIT_EVERY", v, 0)
    if (v := get("MPIDP_AUDIT_ACTION")) is not None:
        kw["audit_action"] = _parse_choice("MPIDP_AUDIT_ACTION", v, AUDIT_ACTIONS)
    if (v := get("MPIDP_EXTENSION")) is not None:
        kw["extension"] = _parse_bool("MPIDP_EXTENSION", v)
    if (v := get("MPIDP_HOROVOD_FUSION_BYTES")) is not None:
        kw["horovod_fusion_bytes"] = _parse_int("MPIDP_HOROVOD_FUSION_BYTES", v, 1)
    if (v := get("MPIDP_RECOVERY")) is not None:
        kw["recovery"] = _parse_choice("MPIDP_RECOVERY", v, RECOVERY_MODES)
    if (v := get("MPIDP_PS_MEMORY")) is not None:
        kw["ps_memory"] = _parse_choice("MPIDP_PS_MEMORY", v, PS_MEMORIES)
    v = get("MPIDP_REQUIRE_EXTENSION")
    if v is not None:
        kw["require_extension"] = _parse_bool("MPIDP_REQUIRE_EXTENSION", v)
    else:
        kw["require_extension"] = bool(get("CI"))
    return Config(**kw)


_current: Config | None = None
_overrides: Callable[[], Mapping[str, str]] | None = None  # set by ``adopt``


def get() -> Config:
    """The process-wide Config, read from the environment on first use (Note [Settings read
    at init]); ConfigError, at every call, while a value is bad."""
    global _current
    if _current is None:
        extra = _overrides() if _overrides is not None else {}
        _current = from_env({**extra, **os.environ} if extra else None)
    return _current


def adopt(overrides: Callable[[], Mapping[str, str]]) -> None:
    """From now on the settings are read with ``overrides()`` (``MPIDP_*`` names and values)
    where the environment sets no value of its own, at the next ``get``: inside mpidp.init's
    agreement, so that a ConfigError ``overrides`` raises is reported on every rank, as a bad
    MPIDP_* value is. How mpidp.horovod's ``init`` applies the HOROVOD_* variables it maps
    (mpidp/horovod/settings.py); called before ``mpidp.init``."""
    global _current, _overrides
    _current, _overrides = None, overrides


def check_group_size(cfg: Config, size: int) -> None:
    """ConfigError where a setting cannot apply to a group of ``size`` ranks: an emulated node
    larger than the group (the nodes of a k that does not divide it are k ranks each and
    the last one the rest, as a real cluster's may be). Called by mpidp.init, after the
    ranks agreed on ``cfg``: every rank raises it."""
    if cfg.emulate_node_size > size:
        raise ConfigError(env_name("emulate_node_size"), str(cfg.emulate_node_size),
                          f"more than the {size} rank(s) of the group: expected 0 (off) or "
                          f"1 to {size}")


def timeline_requested() -> bool:
    """Whether ``MPIDP_TIMELINE`` (or HOROVOD_TIMELINE, which mpidp.horovod maps to it) names
    a file, read without the other settings (so it never raises): what
    mpidp.runtime.timeline's ``traced`` decides by when a module is imported (Note [Timeline
    cost]), and what lets ``hvd.start_timeline`` start one (HOROVOD_TIMELINE=DYNAMIC too: Note
    [A timeline started while running]); the timeline itself starts with ``mpidp.init()``."""
    return bool(_timeline(os.environ) or os.environ.get("HOROVOD_TIMELINE", "").strip())
