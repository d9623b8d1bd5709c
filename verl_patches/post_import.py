"""Run a patch when a module is imported, not before: `when_imported(name, patch)`.

The plugin sets up a CPU run's Ray workers at `import verl`, but most of those processes (the
pipeline's stages) never load the modules patched, and importing them only to patch them costs each
process about 1 s of CPU. `when_imported` calls `patch()` at once where the module is already
loaded, otherwise right after the module's own code has run, before the import that loaded it
returns (so a `from module import name` elsewhere already sees the patched name). Each patch runs
once per process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Callable

_PENDING: dict[str, list[Callable[[], None]]] = {}
_LOCK = threading.RLock()


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, then its pending patches; the module keeps its own loader afterwards."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        with _LOCK:
            patches = _PENDING.pop(module.__name__, [])
        for patch in patches:
            patch()


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds a module with a pending patch through the other finders and wraps its loader."""

    def find_spec(self, name, path, target=None):
        if name not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_FINDER = _PostImportFinder()


def when_imported(name: str, patch: Callable[[], None]) -> None:
    """Call `patch()` once module `name` is imported in this process (now, where it already is)."""
    with _LOCK:
        if name not in sys.modules:
            _PENDING.setdefault(name, []).append(patch)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    patch()


def pending() -> list[str]:
    """The modules with a patch still waiting for their import."""
    with _LOCK:
        return sorted(_PENDING)
