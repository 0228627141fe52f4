"""Tensor wrapper subclasses built in Python around simulated tensors (``AsyncCollectiveTensor``
of ``torch/distributed/_functional_collectives.py``, made by every functional collective and by
its ``__torch_dispatch__`` for view ops on one): they call ``Tensor._make_wrapper_subclass(...,
device=elem.device)``, and the function mode answers ``elem.device`` with the ``cuda:N`` the
script must see, although ``elem`` is a meta tensor. A ``cuda`` wrapper around a meta tensor
then fails DTensor's ``detach`` when autograd unpacks a saved tensor (``checkSetStorage``:
"Attempted to set the storage of a tensor on device cuda:0 to a storage on different device
meta"). A CPU build has no CUDA tensors, so in a simulated run a CUDA wrapper is made where its
inner tensor is (meta, or the PrivateUse1 engine's device: the function mode's ``device_for``);
the script still sees ``cuda:N`` (`SimState.seen_idx` looks inside)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["make_wrapper_subclass"]


def make_wrapper_subclass(original: Callable[..., Any], device_for: Callable[[int], torch.device]) -> Any:
    """``Tensor._make_wrapper_subclass`` with a ``cuda:N`` device made ``device_for(N)``."""
    from vram.frontend import memory as _memory

    def make(cls: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and (d := torch.device(device)).type == "cuda":
            kwargs["device"] = device_for(_memory.current_device() if d.index is None else d.index)
        return original(cls, *args, **kwargs)
    return staticmethod(make)
