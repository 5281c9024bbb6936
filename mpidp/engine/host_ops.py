"""The host array seam: reduce, divide, and bucket pack/unpack (casting too) on flat host
buffers, by the C extension or, where it is not built (or MPIDP_EXTENSION=0), by its numpy
twin — an error instead when MPIDP_REQUIRE_EXTENSION (or CI) is set. Without the extension
there is no shared-memory algorithm either: ``auto`` then runs one-node collectives over MPI
(Note [Auto choice] in mpidp/algorithms.py)."""
from __future__ import annotations

import warnings

from .. import config
from ..errors import BackendUnavailableError

try:
    from .. import _ext
except ImportError as exc:  # pragma: no cover - exercised by an install without a compiler
    _ext = None
    _why = str(exc)
else:
    _why = ""
if _ext is not None and not config.get().extension:
    _ext, _why = None, "disabled by MPIDP_EXTENSION=0"


def extension():
    """The compiled ``mpidp._ext`` module, or BackendUnavailableError saying how to build it."""
    if _ext is None:
        raise BackendUnavailableError(
            f"mpidp's C extension is not available ({_why}); reinstall with a C compiler "
            "present: pip install -e . (or pip install mpidp)")
    return _ext


def _select():
    if _ext is not None:
        return _ext
    if config.get().require_extension and config.get().extension:
        extension()
    warnings.warn(f"mpidp: C extension unavailable ({_why}): reductions use its numpy twin, "
                  "and one-node collectives run over MPI instead of shared memory",
                  RuntimeWarning, stacklevel=3)
    from . import host_ops_numpy  # only where the extension is missing
    return host_ops_numpy


EXTENSION = _ext  # None where the extension is missing or disabled
_impl = _select()
divide = _impl.divide
pack = _impl.pack
unpack = _impl.unpack
cast_segments = _impl.cast_segments
IMPLEMENTATION = "c" if _impl is _ext else "numpy"


def reduce_into(dst, src, dtype: int, op: int, divisor: int = 1) -> None:
    """dst = dst <op> src element-wise, then divided by ``divisor`` when it is > 1."""
    _impl.reduce_into(dst, src, dtype, op)
    if divisor > 1 and len(dst):
        _impl.divide(dst, dtype, divisor)
