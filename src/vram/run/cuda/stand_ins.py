"""Stand-ins for C classes a CPU build of torch makes differently from a GPU build (``torch.device``
given an index alone, ``torch.Generator(device="cuda")``), and the attribute patches that put them
in place and take them back."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vram.frontend import memory as _memory


def _stand_in(real: type, make: Callable[..., Any]) -> type:
    """A class standing in for the C class `real` under its own name: calling it is `make`,
    its instances are `real`'s (``isinstance``/``issubclass`` checks still hold), and its other
    attributes are `real`'s."""

    class StandIn(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub: Any) -> bool:
            return issubclass(sub, real)

        def __getattr__(cls, name: str) -> Any:
            return getattr(real, name)

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            return make(*args, **kwargs)

    return StandIn(real.__name__, (), {"__module__": "torch", "__doc__": real.__doc__})


def device_type(real: type) -> type:
    """``torch.device`` accepting an index alone: ``torch.device(0)`` is the current accelerator's
    device 0 (``THPDevice_pynew``, torch/csrc/Device.cpp, ``at::getAccelerator``), CUDA on a GPU
    build, a refusal on a CPU one (FSDP1's ``_get_compute_device`` does it for a root without
    parameters). Instances are the real ``torch.device``."""

    def make(*args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool):
            return real("cuda", args[0])
        return real(*args, **kwargs)

    return _stand_in(real, make)


class SimulatedGenerator(torch._C.Generator):
    """A CUDA generator of the simulated GPU: a CPU generator whose ``device`` is ``cuda:N``.
    Random ops on simulated tensors draw only the values vram keeps (`vram.run.values.known`), from
    it. Its ``get_state`` is the CPU generator's (a CUDA generator's is 16 bytes of Philox seed
    and offset)."""

    _vram_index: int

    def __new__(cls, index: int) -> SimulatedGenerator:
        g = torch._C.Generator.__new__(cls)
        g._vram_index = index
        return g

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._vram_index)

    def __reduce__(self) -> Any:  # copy/deepcopy/pickle: the same device and state
        return _restored_generator, (self._vram_index, self.get_state())


def _restored_generator(index: int, state: torch.Tensor) -> SimulatedGenerator:
    g = SimulatedGenerator(index)
    g.set_state(state)
    return g


def generator_type(real: type) -> type:
    """``torch.Generator`` that can make CUDA generators. On a CPU build ``torch.Generator(device=
    "cuda")`` raises "Cannot get CUDA generator without ATen_cuda library"; diffusers pipelines and
    sampling scripts make one (``torch.Generator(device).manual_seed(0)``). On a GPU its ``device``
    is ``cuda:N``, N the given index else the current device (``THPGenerator_pynew``,
    torch/csrc/Generator.cpp, asks the CUDA hooks for a new generator on that index): here a
    `SimulatedGenerator`. Other devices get the real one."""

    def make(device: Any = None) -> Any:
        if device is not None and torch.device(device).type == "cuda":
            return SimulatedGenerator(_memory._device_index(torch.device(device)))
        return real() if device is None else real(device)

    return _stand_in(real, make)


def attribute_patches() -> tuple[Callable[[Any, str, Any], None], Callable[[], None]]:
    """``(put, restore)``: ``put(owner, name, value)`` sets an attribute and remembers the old one
    (or its absence); ``restore()`` puts every one back, last first."""
    saved: list[tuple[Any, str, Any]] = []
    missing = object()

    def put(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name, missing)))
        setattr(owner, name, value)

    def restore() -> None:
        for owner, name, old in reversed(saved):
            if old is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        saved.clear()

    return put, restore
