"""Exceptions mpidp raises: communication failures, cross-rank mismatches, bad settings,
missing backends."""
from __future__ import annotations


class MpidpError(RuntimeError):
    """Base of mpidp's own runtime errors."""


class NotInitializedError(MpidpError):
    """A collective was called before ``mpidp.init()``."""


class CommunicationError(MpidpError):
    """A collective failed: names the rank, the operation and the cause."""

    def __init__(self, rank: int, operation: str, cause: str):
        self.rank, self.operation, self.cause = rank, operation, cause
        super().__init__(f"rank {rank}: {operation} failed: {cause}")


class WaitTimeoutError(CommunicationError):
    """A collective waited longer than its group's timeout for other ranks to reach it:
    ``late`` are those ranks — local ranks of the node where the shared-memory protocol
    waited (``across`` False), ranks of the group where a wait across nodes did (``across``
    True) — and ``timeout_s`` the limit. The collective cannot be taken back: the ranks that
    did arrive may have gone on with it (Note [A group's timeout] in mpidp/backend/group.py)."""

    def __init__(self, rank: int, operation: str, timeout_s: float, late, cause: str,
                 across: bool = False):
        self.timeout_s, self.late, self.across = timeout_s, tuple(late), across
        super().__init__(rank, operation, cause)


class MismatchError(MpidpError, ValueError):
    """Ranks called a collective with inputs that do not agree; raised on every rank."""


class ConfigError(MpidpError, ValueError):
    """An ``MPIDP_*`` variable holds a value mpidp does not accept. ``str()`` is one line
    naming the variable, its value and what is accepted (docs/configuration.md); ``where``
    prefixes it ("rank 1: ") where another rank's value was the bad one. Raised by
    ``mpidp.init()`` on every rank, never by ``import mpidp``."""

    def __init__(self, variable: str, value: str, expected: str, where: str = ""):
        self.variable, self.value, self.expected, self.where = variable, value, expected, where
        super().__init__(f"{where}{variable}={value!r}: {expected}")

    def __reduce__(self):  # pickles (its fields, not its message) for another rank
        return (type(self), (self.variable, self.value, self.expected, self.where))


class BackendUnavailableError(ImportError):
    """An optional backend (the C extension, CuPy, NCCL) is missing; says how to install it."""


class LaunchError(MpidpError):
    """The job was not started as the launcher says: N independent singletons instead of one
    world of N ranks (see Note [Independent singletons] in mpidp/runtime/launcher.py)."""


class OutputError(OSError):
    """A file mpidp writes (a checkpoint, the JSON log, the timeline, benchmark results) could
    not be written. ``str()`` is one line naming what, the path and the cause; ``errno``,
    ``strerror`` and ``filename`` are the cause's (Note [Writing a file] in mpidp/files/__init__.py)."""

    def __init__(self, what: str, path, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.what = what

    def __str__(self) -> str:
        return f"cannot write {self.what} {self.filename}: {self.strerror}"
