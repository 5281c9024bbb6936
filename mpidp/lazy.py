"""Public names of a package loaded from their modules on first access, so that importing
the package stays cheap and starts nothing (``import mpidp`` imports neither MPI nor torch)."""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping, Tuple


def exports(package: str, table: Mapping[str, str],
            modules: Mapping[str, str] = {}) -> Tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package`` whose public name N is defined in
    its module ``table[N]``, and whose public module M is its module ``modules[M]``."""

    def __getattr__(name: str):
        module = table.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
        elif name in modules:
            value = importlib.import_module(f"{package}.{modules[name]}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(table) | set(modules))

    return __getattr__, __dir__
