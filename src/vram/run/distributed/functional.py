"""The functional collectives (``torch.ops._c10d_functional``, behind DTensor's redistributions
and ``torch.distributed._functional_collectives``) where their Meta kernels would allocate what
the CUDA ones do not (``torch/distributed/_functional_collectives.py``,
``torch/csrc/distributed/c10d/Functional.cpp``).

* ``wait_tensor(t)`` waits for the collective that produces ``t`` and returns ``t`` itself
  (``Functional.cpp``); its Meta kernel returns ``empty_like(t)``.
* ``_wrap_tensor_autograd(t)`` (``_maybe_wrap_tensor`` in eager) returns
  ``AsyncCollectiveTensor(t)``, a wrapper around the same storage; its fake kernel returns
  ``empty_like(t)``.

The collectives themselves (``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
...) allocate in their Meta kernels what ``Functional.cpp`` allocates (``input.clone()`` /
``at::empty(output size)``) and keep those kernels.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["overrides"]


def overrides() -> dict[Any, Any]:
    """Op overload -> its CUDA behaviour, for `vram.run.storages.SimState.ops`."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    ops = torch.ops._c10d_functional
    return {
        ops.wait_tensor.default: lambda t: t,
        ops._wrap_tensor_autograd.default: lambda t: AsyncCollectiveTensor(t),
    }
