"""The torch.distributed backend's first name: ``import mpidp.dist`` (and ``mpidp.dist.X``,
``mpidp.dist:autoload`` in an entry point installed before the move) is ``mpidp.backend``,
the very module objects, so that nothing of the backend exists twice (Note [The backend's old
name]).

Note [The backend's old name]
The backend lived in ``mpidp/dist/`` until issue 46: the one folder name Python's tooling
treats as build output (ruff's default exclude, GitHub's Python .gitignore), and a name that
``import torch.distributed as dist`` shadows inside it. Users were given ``import mpidp.dist``,
so this module stays: it replaces itself in ``sys.modules`` by ``mpidp.backend`` and answers
``mpidp.dist.<sub>`` with ``mpidp.backend.<sub>`` (a finder on ``sys.meta_path``), where a
plain re-export would let ``import mpidp.dist.group`` load a second copy of the module, with
its own registration flags and threads."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD, NEW = __name__, __name__.rsplit(".", 1)[0] + ".backend"


def autoload() -> None:
    """The entry point of an install made before the move (``mpidp.dist:autoload``): torch
    may call it while ``mpidp.backend`` is still being imported from here, so looked up late."""
    importlib.import_module(NEW).autoload()



_OWN_SPECS: dict = {}  # alias name -> the real module's spec, between create and exec


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``mpidp.dist.<sub>`` -> the module ``mpidp.backend.<sub>``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(OLD + "."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module(NEW + spec.name[len(OLD):])
        _OWN_SPECS[spec.name] = module.__spec__  # the import system sets the alias's next
        return module

    def exec_module(self, module):
        # already executed under its own name, which it keeps
        module.__spec__ = _OWN_SPECS.pop(module.__spec__.name)


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
sys.modules[OLD] = importlib.import_module(NEW)
