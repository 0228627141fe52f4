"""``vram estimate`` / ``vram.estimate(...)``: a training step's GPU memory, predicted by running
it under the simulated-CUDA runtime (`vram.run`) and attributing every allocation to a phase,
a category and a module. Needs the ``torch`` extra.

``vram.estimate`` is this package, and it is callable: ``vram.estimate(model, inputs, ...)`` calls
`vram.estimate.engine.estimate`; with ``layout=`` (a `vram.estimate.layout.Layout` or a dict such
as ``{"fsdp": 8}``; ``max_batch=True`` searches the largest per-rank batch), every rank of that
multi-GPU layout, as ``vram estimate --ddp/--fsdp/--tp/--pp`` does
(`vram.estimate.distributed.estimate_on_layout`, returning a ``LayoutEstimate``).
"""
from __future__ import annotations

import sys
import types
from typing import Any

from .engine import CATEGORIES, EstimateResult, estimate, fits, max_batch

__all__ = ["CATEGORIES", "EstimateResult", "estimate", "fits", "max_batch"]


class _CallableModule(types.ModuleType):
    """``vram.estimate`` is both this package and, called, the `estimate` function."""

    def __call__(self, *args: Any, layout: Any = None, **kwargs: Any) -> Any:
        if layout is not None:
            from .distributed import estimate_on_layout

            return estimate_on_layout(*args, layout=layout, **kwargs)
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
