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

__all__ = ["device_state_on", "rebuild_on_meta"]


def rebuild_on_meta(original: Callable[[Any], object]) -> Callable[[Any], object]:
    """``_rebuild_tensor_from_dtensor_meta`` with a ``cuda`` mesh's tensors made on ``meta``."""

    def rebuild(arg: Any) -> object:
        if arg.mesh.device_type != "cuda" or arg.tensor_meta is None:
            return original(arg)
        meta = arg.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    return rebuild


def device_state_on(original: Callable[[Any], Any], device_for: Callable[[int], Any]) -> Callable[[Any], Any]:
    """``OffsetBasedRNGTracker._get_device_state`` (torch/distributed/tensor/_random.py:
    ``get_rng_state().to(self._device)``) with a ``cuda`` mesh's state moved to the engine's
    device for that GPU. DTensor calls it from its dispatch, where no function mode turns
    ``cuda`` into the simulated device, so a CPU build's dispatcher got a CUDA tensor."""

    def get_device_state(self: Any) -> Any:
        device = self._device
        if device.type != "cuda":
            return original(self)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self._device_handle.get_rng_state().to(device_for(index))
    return get_device_state
