"""``vram estimate`` / ``vram.estimate(...)``: a training step's GPU memory, predicted by running
it under the simulated-CUDA runtime (`vram.run`) and attributing every allocation to a phase,
a category and a module. Needs the ``torch`` extra.

``vram.estimate`` is this package, and it is callable: ``vram.estimate(model, inputs, ...)`` calls
`vram.estimate.engine.estimate`.
"""
from __future__ import annotations

import sys
import types
from typing import Any

from .engine import CATEGORIES, EstimateResult, estimate, fits, max_batch

__all__ = ["CATEGORIES", "EstimateResult", "estimate", "fits", "max_batch"]


class _CallableModule(types.ModuleType):
    """``vram.estimate`` is both this package and, called, the `estimate` function."""

    def __call__(self, *args: Any, **kwargs: Any) -> EstimateResult:
        return estimate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
