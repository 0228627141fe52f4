"""Calls that take their device and dtype from another tensor or a legacy type name.

``x.to(other)`` and ``x.type_as(other)`` are ``x.to(other.options())`` in C++
(``aten/src/ATen/native/TensorConversions.cpp``: ``to(const Tensor&, const Tensor& other, ...)``;
``type_as`` in ``native_functions.yaml`` is ``self.to(other.options())``), and ``x.type(T)`` /
``x.type()`` name a legacy tensor type (``torch/csrc/utils/tensor_types.cpp``: ``"torch.FloatTensor"``,
``"torch.cuda.HalfTensor"``). Below the function mode, a simulated tensor's device is the engine's
and a lazy host tensor's is meta (`vram.run.memory.lazy_host`), so C++ would read those: a host
tensor ``type_as`` a lazy host one would become a meta tensor with no data, and ``type()`` would
say ``torch.meta.FloatTensor``. Here each such call is rewritten, above the modes, into the device
and dtype the script sees: ``to(device, dtype, ...)``, or the type name a GPU run prints.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_CPU = torch.device("cpu")
#: ``to(other, non_blocking, copy, memory_format)``'s keyword arguments that ``to(device, dtype, ...)`` shares
_TO_KWARGS = ("non_blocking", "copy", "memory_format")

Played = Callable[[torch.Tensor], "torch.device | None"]


def legacy_type_name(t: torch.Tensor, device: torch.device) -> str:
    """``Tensor.type()`` for a tensor of `t`'s dtype on `device`: ``torch.FloatTensor`` on the
    host, ``torch.cuda.FloatTensor`` on a GPU."""
    with torch._C.DisableTorchFunction():
        name = torch.empty(0, dtype=t.dtype).type()
    return name.replace("torch.", "torch.cuda.", 1) if device.type == "cuda" else name


def _legacy_type(value: Any) -> tuple[torch.device, torch.dtype] | None:
    """(device, dtype) of a legacy tensor type: a name (``"torch.cuda.HalfTensor"``) or its class."""
    if isinstance(value, str):
        prefix, _, last = value.rpartition(".")
        owner = {"torch": torch, "torch.cuda": torch.cuda}.get(prefix)
        value = getattr(owner, last, None) if owner is not None and last.endswith("Tensor") else None
    dtype = getattr(value, "dtype", None)
    if not isinstance(value, type) or not isinstance(dtype, torch.dtype) or value is torch.Tensor:
        return None
    return (torch.device("cuda") if getattr(value, "is_cuda", False) else _CPU), dtype


def rewrite(name: str, args: Any, kwargs: dict[str, Any], played: Played) -> Any:
    """For ``to(other)``, ``type_as(other)`` and ``type(T)`` on or with a tensor whose device
    the script sees differently (`played`: its device to the script, or None for a plain one):
    the ``Tensor.to`` arguments ``(args, kwargs)`` that ask for the same device and dtype;
    for ``type()``: the type name; None when the call needs no rewriting."""
    t0 = args[0]
    if name in ("to", "type_as"):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if not isinstance(other, torch.Tensor) or (device := played(other)) is None:
            return None
        rest = {k: v for k, v in kwargs.items() if k in _TO_KWARGS}
        return (t0, device, other.dtype, *args[2:]), rest
    if name != "type":
        return None
    target = args[1] if len(args) > 1 else kwargs.get("dtype")
    own = played(t0)
    if target is None:
        return legacy_type_name(t0, own) if own is not None else None
    legacy = _legacy_type(target)
    if legacy is None or (own is None and legacy[0].type == "cpu"):
        return None  # a dtype keeps the device (as C++ does); a plain host tensor to a host type
    rest = {"non_blocking": kwargs["non_blocking"]} if "non_blocking" in kwargs else {}
    return (t0, legacy[0], legacy[1], *args[2:3]), rest
