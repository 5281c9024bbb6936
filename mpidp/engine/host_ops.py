"""The host array seam: reduce, divide, and bucket pack/unpack (casting too) on flat host
buffers, by the C extension or, where it is not built (or MPIDP_EXTENSION=0), by its numpy
twin — an error instead when MPIDP_REQUIRE_EXTENSION (or CI) is set. Without the extension
there is no shared-memory algorithm either: ``auto`` then runs one-node collectives over MPI
(Note [Auto choice] in mpidp/algorithms.py)."""
from __future__ import annotations

import warnings

from .. import config
from ..errors import BackendUnavailableError
from . import header

try:
    from .. import _ext as _built
except ImportError as exc:  # pragma: no cover - exercised by an install without a compiler
    _built, BUILD_PROBLEM = None, str(exc)
else:
    BUILD_PROBLEM = ""  # why the extension could not be imported ("": it is built)

# Which implementation runs depends on MPIDP_EXTENSION and MPIDP_REQUIRE_EXTENSION, so it is
# chosen on first use (mpidp.init, or a kernel called before it), not at import (Note
# [Settings read at init] in mpidp/config.py): until then the names below come from the
# module's __getattr__ (and reduce_into's _impl from _Unchosen), which chooses and binds them
# as plain module globals, so that later calls cost nothing more.
_CHOSEN = ("EXTENSION", "IMPLEMENTATION", "divide", "pack", "unpack", "cast_segments",
           "host_view", "tensor_view")


def _choose() -> None:
    """Binds the kernels: the C extension, or its numpy twin where the extension is missing
    or disabled (a warning), or BackendUnavailableError where it is required."""
    cfg = config.get()
    ext, why = _built, BUILD_PROBLEM
    if ext is not None and not cfg.extension:
        ext, why = None, "disabled by MPIDP_EXTENSION=0"
    if ext is not None and (stale := header.check_wire(getattr(ext, "WIRE", {}))):
        ext, why = None, stale  # never pairs headers it does not read as Python writes them
    if ext is None:
        if cfg.require_extension and cfg.extension:
            raise _unavailable(why)
        warnings.warn(f"mpidp: C extension unavailable ({why}): reductions use its numpy "
                      "twin, and one-node collectives run over MPI instead of shared memory",
                      RuntimeWarning, stacklevel=3)
        from . import host_ops_numpy as impl  # only where the extension is missing
    else:
        impl = ext
    globals().update(_ext=ext, _why=why, _impl=impl, EXTENSION=ext,  # None: missing or disabled
                     IMPLEMENTATION="c" if impl is ext else "numpy", divide=impl.divide,
                     pack=impl.pack, unpack=impl.unpack, cast_segments=impl.cast_segments,
                     host_view=impl.host_view,  # Note [Host views] in csrc/view.c
                     tensor_view=impl.tensor_view)  # Note [Tensor views in C] there


def __getattr__(name: str):
    if name in _CHOSEN:
        _choose()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Unchosen:
    """``_impl`` until the kernels are chosen: its first attribute chooses them."""

    def __getattr__(self, name: str):
        _choose()
        return getattr(_impl, name)


_impl = _Unchosen()


def _unavailable(why: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"mpidp's C extension is not available ({why}); reinstall with a C compiler "
        "present: pip install -e . (or pip install mpidp)")


def extension():
    """The compiled ``mpidp._ext`` module, or BackendUnavailableError saying how to build it
    (where it is missing, or disabled by MPIDP_EXTENSION=0)."""
    if "_ext" not in globals():
        _choose()
    if _ext is None:
        raise _unavailable(_why)
    return _ext


def reduce_into(dst, src, dtype: int, op: int, divisor: int = 1) -> None:
    """dst = dst <op> src element-wise, then divided by ``divisor`` when it is > 1."""
    _impl.reduce_into(dst, src, dtype, op)
    if divisor > 1 and len(dst):
        _impl.divide(dst, dtype, divisor)
