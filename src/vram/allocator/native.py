"""The optional compiled allocator: the same modules, compiled with mypyc.

The pure-Python modules are the implementation and the readable reference. ``python3 -m
vram.allocator.native_build`` compiles `COMPILED` — the hot paths: blocks and pools, stats,
malloc/free, expandable segments, release, history — with mypyc (``pip install mypy``, a C
compiler) into ``vram/allocator/_native/``. They are used only when asked for, with
``VRAM_NATIVE=1`` (or ``VRAM_NATIVE=DIR`` for a build elsewhere), and only if the build matches
this Python and these exact sources (SHA-256 of each module, recorded at build time). Otherwise —
not built, built for another interpreter, sources edited since, or a module that fails to load —
vram says why in one warning and runs the pure-Python modules, with identical results
(``tests/test_native.py`` compares both, byte for byte, on random workloads and every recording).

Not compiled: ``config`` (a construct mypyc 2.4 cannot compile) and ``errors`` (a subclass of a
builtin exception); they are not on the hot path.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, TypeVar

__all__ = ["ACTIVE", "COMPILED", "ENV", "mypyc_attr", "select", "trait"]

_T = TypeVar("_T")

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr, trait
else:
    def trait(cls: _T) -> _T:
        """``mypy_extensions.trait``: marks the allocator's mixins as mypyc traits; nothing at run time."""
        return cls

    def mypyc_attr(**_: object) -> Callable[[_T], _T]:
        """``mypy_extensions.mypyc_attr``: options for mypyc; nothing at run time."""
        return lambda cls: cls

#: the modules the compiled build replaces, in import order
COMPILED = ("stats", "block", "history", "checks", "expandable", "release", "pools", "caching")
ENV = "VRAM_NATIVE"
HERE = Path(__file__).resolve().parent
DEFAULT_DIR = HERE / "_native"
GROUP = "vram.allocator.core_native"  # mypyc's shared library: core_native__mypyc.<abi>.so
MANIFEST = "manifest.json"
#: whether this process runs the compiled modules (set once, by `select`, at import)
ACTIVE = False


def _tag() -> str:
    return f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"


def _sources() -> dict[str, str]:
    return {name: hashlib.sha256((HERE / f"{name}.py").read_bytes()).hexdigest() for name in COMPILED}


def _unusable(folder: Path) -> str | None:
    """Why the build in `folder` cannot be used here, or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no compiled build in {folder} (python3 -m vram.allocator.native_build)"
    tag = manifest.get("tag") if isinstance(manifest, dict) else None
    if tag != _tag():
        return f"the build in {folder} is for {tag}, not {_tag()}"
    if manifest.get("sources") != _sources():
        return f"the sources changed since the build in {folder} (rebuild it)"
    return None


def _open_instances(caching: ModuleType) -> None:
    """Give the compiled `CachingAllocator` an interpreted subclass under its name, so that its
    instances take attributes as pure-Python ones do (`vram.estimate` shadows ``malloc`` and
    ``free`` on one allocator); the methods are the compiled ones."""
    compiled = getattr(caching, "CachingAllocator")  # noqa: B009 - a module known only at run time
    setattr(caching, "CachingAllocator", type(compiled.__name__, (compiled,), {  # noqa: B010 - as above
        "__module__": compiled.__module__, "__qualname__": compiled.__qualname__, "__doc__": compiled.__doc__}))


def select(path: list[str]) -> None:
    """Put the compiled build first on the package's `path` (``vram.allocator.__path__``) when
    ``VRAM_NATIVE`` asks for it and it can be used; else leave the pure-Python modules."""
    global ACTIVE
    setting = os.environ.get(ENV, "")
    if setting in ("", "0"):
        return
    folder = DEFAULT_DIR if setting == "1" else Path(setting).resolve()
    why = _unusable(folder)
    if why is None:
        path.insert(0, str(folder))
        try:
            for name in COMPILED:
                module = importlib.import_module(f"{__package__}.{name}")
                if not str(getattr(module, "__file__", "")).startswith(str(folder)):
                    raise ImportError(f"{module.__name__} did not load from the build")
        except Exception as exc:  # noqa: BLE001 - any failure to load: fall back, saying why
            why = f"the build in {folder} does not load ({type(exc).__name__}: {exc})"
            path.remove(str(folder))
            for name in (*COMPILED, "core_native__mypyc"):
                sys.modules.pop(f"{__package__}.{name}", None)
        else:
            _open_instances(sys.modules[f"{__package__}.caching"])
            ACTIVE = True
            return
    warnings.warn(f"{ENV}={setting}: running the pure-Python allocator: {why}", RuntimeWarning, stacklevel=3)
