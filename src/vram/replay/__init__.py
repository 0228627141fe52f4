"""Layer 4, replay of recorded snapshots: `loader` (safe reading of untrusted files), `rewind` (the
state at a trace's first event), `state` (importing a segment layout), `cycles` (exact skipping of
repeated periods) and `engine` (replay, what-if configs, verification).

``vram.replay`` is this package, and it is callable: ``vram.replay("run.pickle", conf=...)`` (or
``from vram.replay import replay``) replays a file, read with the safe loader, or an already
loaded snapshot, through `vram.replay.engine.replay`.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any

__all__ = ["replay"]


def replay(snapshot: Any, **kwargs: Any) -> Any:
    """`vram.replay.engine.replay` of `snapshot`: a path (``str`` or ``os.PathLike``: a PyTorch pickle,
    legacy pickle, JSON snapshot or RMM CSV, read by `vram.replay.loader.load_snapshot`) or a
    loaded snapshot dict. Keywords as the engine's: ``gpu``, ``context`` (as ``vram replay``'s
    ``--context``: by default the measured `vram.devices.gpus.CUDA_CONTEXT` with a ``gpu``, else 0),
    ``conf``, ``verify``, ``device``, ``stop_at``, ``timeline``. Returns a
    `vram.replay.engine.ReplayResult`."""
    from vram.devices.gpus import context_on

    from .engine import replay as _replay

    kwargs["context"] = context_on(kwargs.get("gpu"), kwargs.get("context"))
    if isinstance(snapshot, (str, os.PathLike)):
        from .loader import load_snapshot

        snapshot = load_snapshot(os.fspath(snapshot))
    return _replay(snapshot, **kwargs)


class _CallableModule(types.ModuleType):
    """``vram.replay`` is both this package and, called, `replay`."""

    def __call__(self, snapshot: Any, **kwargs: Any) -> Any:
        return replay(snapshot, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
