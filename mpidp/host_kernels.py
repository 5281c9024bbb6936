"""The host array seam: reduce, divide, and bucket pack/unpack on flat host buffers, by the C extension or, where it
is not built, by its numpy twin (an error instead when MPIDP_REQUIRE_EXTENSION / CI is set)."""
from __future__ import annotations

import warnings

from . import config
from .errors import BackendUnavailableError

try:
    from . import _ext
except ImportError as exc:  # pragma: no cover - exercised by an install without a compiler
    _ext = None
    _import_error = exc
else:
    _import_error = None


def extension():
    """The compiled ``mpidp._ext`` module, or BackendUnavailableError saying how to build it."""
    if _ext is None:
        raise BackendUnavailableError(
            f"mpidp's C extension is not built ({_import_error}); reinstall with a C compiler "
            "present: pip install -e . (or pip install mpidp)")
    return _ext


def _select():
    if _ext is not None:
        return _ext
    if config.get().require_extension:
        extension()
    warnings.warn(f"mpidp: C extension unavailable ({_import_error}); using the numpy twin",
                  RuntimeWarning, stacklevel=3)
    from . import host_kernels_numpy
    return host_kernels_numpy


_impl = _select()
divide = _impl.divide


def reduce_into(dst, src, dtype: int, op: int, divisor: int = 1) -> None:
    """dst = dst <op> src element-wise, then divided by ``divisor`` when it is > 1."""
    _impl.reduce_into(dst, src, dtype, op)
    if divisor > 1 and len(dst):
        _impl.divide(dst, dtype, divisor)



pack = _impl.pack
unpack = _impl.unpack
IMPLEMENTATION = "c" if _impl is _ext else "numpy"
