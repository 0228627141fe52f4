"""``bincount`` and ``histc`` on CUDA (layer 4; needs torch): ``native/cuda/SummaryOps.cu``.

``_bincount_cuda``: weights neither absent nor float32 are converted first (``weights.to(kDouble)``,
a copy unless already double, freed when the call returns); ``_bincount_cuda_template`` reads
``self.min()`` (not for uint8) and ``self.max()`` to the host, each a 0-dim reduction output
(`vram.run.kernels.reductions`, with its staging) dying with its statement, then makes the output
(``zeros({nbins})``); an empty input makes only ``zeros({minlength})``. ``_histc_cuda_template``
makes its output first, then reads ``self.min()`` and ``self.max()`` when ``min == max`` (the range
from the data). ``CUDA_tensor_histogram`` itself allocates nothing (shared or global atomics).
"""
from __future__ import annotations

from typing import Any

import torch

from .reductions import reduction_plan
from .scratch import _Plan

OPS = frozenset({"bincount", "histc"})


def _extremum(p: _Plan, name: str, x: torch.Tensor, sms: int, max_threads_sm: int) -> None:
    """``self.min()`` / ``self.max()`` read to the host: its 0-dim output and staging, freed."""
    out = torch.empty((), dtype=x.dtype, device="meta")
    p.splice(reduction_plan(name, (x,), [out], sms, max_threads_sm), [(name, x.element_size())], name)
    p.free(name)


def histogram_plan(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[Any], sms: int,
                   max_threads_sm: int) -> list[tuple[str, Any]] | None:
    """The order of `OPS`' allocations (module doc); None for other ops."""
    if name not in OPS or not args or not isinstance(args[0], torch.Tensor) or len(outs) != 1:
        return None
    x, p = args[0], _Plan()
    if name == "histc":
        lo = args[2] if len(args) > 2 else kwargs.get("min", 0)
        hi = args[3] if len(args) > 3 else kwargs.get("max", 0)
        p.steps.append(("out", 0))
        if lo == hi and x.numel() > 0:
            _extremum(p, "min", x, sms, max_threads_sm)
            _extremum(p, "max", x, sms, max_threads_sm)
        return p.steps
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    if isinstance(weights, torch.Tensor) and weights.dtype not in (torch.float32, torch.float64):
        p.tmp("weights", weights.numel() * 8)
    if x.numel() > 0:
        if x.dtype != torch.uint8:
            _extremum(p, "min", x, sms, max_threads_sm)
        _extremum(p, "max", x, sms, max_threads_sm)
    p.steps.append(("out", 0))
    p.free("weights")
    return p.steps
