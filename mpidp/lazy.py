"""Public names of a package loaded from their modules on first access, so that importing
the package stays cheap and starts nothing (``import mpidp`` imports neither MPI nor torch)."""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping, Tuple


def exports(package: str, table: Mapping[str, str]) -> Tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose public name N is defined in
    its module ``table[N]``."""

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(table))

    return __getattr__, __dir__
