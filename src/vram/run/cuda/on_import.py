"""Patches for modules a script may never import, applied when it imports them.

Some of PyTorch's modules that a simulated run patches are slow to import and most scripts never
use (``torch.distributed.tensor`` imports sympy: a second of start-up). `when_imported` patches
such a module at once if it is imported, and otherwise right after it is executed, before the
importer gets it: a finder first on ``sys.meta_path`` wraps the module's loader, only for the
names waited for (every other import is untouched).
"""
from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

Patch = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the patches."""

    def __init__(self, loader: Any, patches: list[Patch]) -> None:
        self.loader, self.patches = loader, patches

    def create_module(self, spec: Any) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        for patch in self.patches:
            patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader...: the loader's own
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.waiting: dict[str, list[Patch]] = {}

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.waiting:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self.waiting.pop(name))
            if not self.waiting and self in sys.meta_path:
                sys.meta_path.remove(self)
        return spec


_FINDER = _Finder()


def when_imported(name: str, patch: Patch) -> Callable[[], None]:
    """Call ``patch(module)`` on module `name` now if it is imported, else right after it is;
    returns the function that cancels a patch still waiting."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return lambda: None
    _FINDER.waiting.setdefault(name, []).append(patch)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)

    def cancel() -> None:
        waiting = _FINDER.waiting.get(name, [])
        if patch in waiting:
            waiting.remove(patch)
        if not waiting:
            _FINDER.waiting.pop(name, None)
        if not _FINDER.waiting and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    return cancel
