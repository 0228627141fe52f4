"""DTensor's sharding propagation on simulated GPUs.

To learn an op's output shape, stride and dtype, DTensor runs the op on fake tensors that
``_rebuild_tensor_from_dtensor_meta`` (``torch/distributed/tensor/_op_schema.py``) makes with
``device=mesh.device_type``. Inside vram's function mode ``cuda`` is answered with ``meta``, but a
Python-level torch function (``nn.init.kaiming_uniform_``, which ``Linear.reset_parameters``
calls) runs its body with that mode off, and a fake ``cuda`` tensor on a CPU build fails in
C++ at ``copy_`` ("PyTorch is not linked with support for cuda devices"; ``uniform_``'s
decomposition ends in ``self.copy_(...)``). Only the output's ``TensorMeta`` (shape, stride,
dtype, no device) is kept, so a ``cuda`` mesh's fake arguments are made on ``meta``: the same
metadata, and nothing a CPU build cannot run."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["rebuild_on_meta"]


def rebuild_on_meta(original: Callable[[Any], object]) -> Callable[[Any], object]:
    """``_rebuild_tensor_from_dtensor_meta`` with a ``cuda`` mesh's tensors made on ``meta``."""

    def rebuild(arg: Any) -> object:
        if arg.mesh.device_type != "cuda" or arg.tensor_meta is None:
            return original(arg)
        meta = arg.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    return rebuild
