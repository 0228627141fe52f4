"""Storages on the simulated GPU where no mode sees them, for `vram.run.runtime` (layer 4; needs
torch): their constructor, pointers, moves and checkpoint location tags.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["patch_storages", "raw_device"]


def raw_device(storage: Any) -> torch.device:
    """The device of `storage` itself (``StorageBase.device``), past `patch_storages`' answer."""
    return torch._C.StorageBase.device.__get__(storage)  # type: ignore[attr-defined,no-any-return]


def patch_storages(address_of: Callable[[Any], int | None],
                   to_device: Callable[[Any, torch.device], Any],
                   location_of: Callable[[Any], str | None],
                   make: Callable[[int, torch.device], Any]) -> Callable[[], None]:
    """Storage-level moves, which no mode sees; returns the restore function.

    * ``torch.UntypedStorage(nbytes, device=...)`` (``THPStorage_pynew``: the device's allocator
      gives `nbytes`), behind ``copy.deepcopy`` of a GPU tensor (``Tensor.__deepcopy__`` clones its
      storage: ``type(self)(self.nbytes(), device=self.device)``; timm's ``ModelEmaV3``, best-model
      copies): `make` returns a simulated storage charged as that allocation, or None for other
      devices. The PrivateUse1 engine has no C++ allocator, so its storage constructor crashed.

    * ``UntypedStorage.data_ptr()``: a simulated storage's simulated address (`address_of` gives
      it, None for other storages), as a CUDA storage's would be — meta storages all say 0, which
      would make every pair of storages look shared (``torch.load`` keeps a storage for reuse by
      the other tensors that share it only when its pointer is not 0; tied-weight detection compares
      pointers).
    * ``UntypedStorage.to(device=)`` / ``.cuda()``, behind ``torch.load(map_location="cuda")`` and
      loading a checkpoint saved on a GPU: `to_device` returns the moved storage (a simulated
      one, charged when CUDA's copy would allocate), or None to leave the move to PyTorch.
    * ``UntypedStorage.cpu()`` (``torch.save``'s copy of every storage): `to_device` with the CPU;
      ``torch.serialization.location_tag`` names a simulated storage's GPU (``cuda:N``, from
      `location_of`), so a checkpoint saved in a simulated run records CUDA, as a GPU run's does
      (and a lazy host storage's "cpu").
    * ``UntypedStorage.device`` (and ``is_cuda``, which reads it): a simulated storage's GPU
      (``cuda:N``, from `location_of`), as on a GPU build; the engine's own device name showed
      through ``tensor.untyped_storage()``. (A lazy host storage still says ``meta``: its clone,
      ``type(self)(nbytes, device=self.device).copy_(self)``, must stay lazy.) `raw_device` reads
      the storage's own device for the simulation's use.
    """
    restore_identity = _patch_identity(address_of, location_of, make)
    restore_moves = _patch_moves(to_device, location_of)

    def restore() -> None:
        restore_moves()
        restore_identity()

    return restore


def _patch_identity(address_of: Callable[[Any], int | None], location_of: Callable[[Any], str | None],
                    make: Callable[[int, torch.device], Any]) -> Callable[[], None]:
    """``UntypedStorage(nbytes, device=)``, ``data_ptr()`` and ``device`` (`patch_storages`)."""
    original_ptr = torch.UntypedStorage.data_ptr

    def new(cls: Any, *args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and set(kwargs) == {"device"} and (
                not args or (len(args) == 1 and isinstance(args[0], int) and not isinstance(args[0], bool))):
            made = make(args[0] if args else 0, torch.device(device))
            if made is not None:
                return made
        return torch._C.StorageBase.__new__(cls, *args, **kwargs)

    def device(self: Any) -> torch.device:
        where = location_of(self)
        return torch.device(where) if where is not None and where != "cpu" else raw_device(self)

    def data_ptr(self: Any) -> int:
        ptr = address_of(self)
        return original_ptr(self) if ptr is None else ptr

    torch.UntypedStorage.__new__ = new  # type: ignore[method-assign]
    torch.UntypedStorage.data_ptr = data_ptr  # type: ignore[method-assign]
    torch.UntypedStorage.device = property(device)  # type: ignore[assignment]

    def restore() -> None:
        torch.UntypedStorage.data_ptr = original_ptr  # type: ignore[method-assign]
        del torch.UntypedStorage.__new__
        del torch.UntypedStorage.device

    return restore


def _patch_moves(to_device: Callable[[Any, torch.device], Any],
                 location_of: Callable[[Any], str | None]) -> Callable[[], None]:
    """``UntypedStorage.to``/``.cuda()``/``.cpu()`` and ``torch.serialization.location_tag``
    (`patch_storages`)."""
    import torch.serialization as serialization
    import torch.storage as storage_module

    original_to = storage_module._to
    original_cpu = torch.UntypedStorage.cpu
    original_tag = serialization.location_tag

    def location_tag(storage: Any) -> str:
        where = location_of(storage) if isinstance(storage, torch.UntypedStorage) else None
        return original_tag(storage) if where is None else where

    def to(self: Any, device: torch.device, non_blocking: bool = False) -> Any:
        moved = to_device(self, device) if isinstance(self, torch.UntypedStorage) else None
        return original_to(self, device, non_blocking) if moved is None else moved

    def cpu(self: Any) -> Any:  # torch.save copies each storage with .cpu()
        moved = to_device(self, torch.device("cpu"))
        return original_cpu(self) if moved is None else moved

    storage_module._to = to  # type: ignore[attr-defined]
    torch.UntypedStorage.cpu = cpu  # type: ignore[method-assign]
    serialization.location_tag = location_tag

    def restore() -> None:
        serialization.location_tag = original_tag
        storage_module._to = original_to  # type: ignore[attr-defined]
        torch.UntypedStorage.cpu = original_cpu  # type: ignore[method-assign]

    return restore
