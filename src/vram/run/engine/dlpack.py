"""Storages on the Python PrivateUse1 backend, made through DLPack so that no storage Python object
exists (a ``StorageImpl``'s PyObject keeps it alive and stops in-place gradient accumulation, see
``tests/test_subclass_formulas.py``) and each storage's death is reported.

NumPy exports a ``uint8`` array over the simulated address (never read) as a DLPack capsule; the
capsule's ``DLTensor`` gets device ``kDLExtDev`` (12: PrivateUse1 in ``aten/src/ATen/DLConvertor.cpp``)
and the tensor's dtype, and ``torch.utils.dlpack.from_dlpack`` wraps it. When PyTorch frees the
storage it calls NumPy's DLPack deleter (C, under the GIL), which drops the array; the array's
buffer holds a `_Block` whose finaliser reports the address. CPython runs finalisers with a
pending error set aside, so a storage that dies while C++ unwinds a Python exception is safe (a
ctypes callback is not: it breaks the error state and crashes at interpreter exit).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

_CPU = torch._C.DispatchKey.CPU
_AS_STRIDED = torch.ops.aten.as_strided.default
#: kDLExtDev (dlpack.h): DLPack's device type for PrivateUse1
EXT_DEV = 12
#: DLPack (code, bits) by dtype (dlpack.h: kDLInt 0, kDLUInt 1, kDLFloat 2, kDLBfloat 4,
#: kDLComplex 5, kDLBool 6)
CODES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.float64: (2, 64), torch.bfloat16: (4, 16),
         torch.int64: (0, 64), torch.int32: (0, 32), torch.int16: (0, 16), torch.int8: (0, 8),
         torch.uint8: (1, 8), torch.uint16: (1, 16), torch.uint32: (1, 32),
         torch.uint64: (1, 64), torch.bool: (6, 8), torch.complex32: (5, 32), torch.complex64: (5, 64),
         torch.complex128: (5, 128)}
#: the address a zero-byte storage gets (never read, never charged)
EMPTY = 1 << 40


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


#: each dtype's DLPack type, each device's DLPack device (made once: `new_storage` copies them in)
_TYPES = {dtype: DLDataType(code, bits, 1) for dtype, (code, bits) in CODES.items()}
_DEVICES: dict[int, DLDevice] = {}
_FROM_DLPACK = torch._C._from_dlpack
_GET_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
_GET_POINTER.restype, _GET_POINTER.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class _Block:
    """Lives exactly as long as one storage; its finaliser reports the storage's death."""

    __slots__ = ("address", "device", "died")

    def __init__(self, address: int, device: int, died: Callable[[int, int], None]) -> None:
        self.address, self.device, self.died = address, device, died

    def __del__(self) -> None:
        self.died(self.device, self.address)


def new_storage(meta: torch.Tensor, device: int, address: int, died: Callable[[int, int], None],
                nbytes: int | None = None) -> torch.Tensor:
    """A PrivateUse1 tensor viewed as `meta` (sizes, strides, offset, dtype) over a new storage of
    ``meta``'s storage size (`nbytes`, when the caller has read it) at `address` on `device`;
    ``died(device, address)`` when it is freed."""
    import numpy as np

    dltype = _TYPES.get(meta.dtype)
    if dltype is None:
        raise NotImplementedError(f"vram run --backend privateuse1: no DLPack code for {meta.dtype} yet")
    size = meta.element_size()
    words = (meta.untyped_storage().nbytes() if nbytes is None else nbytes) // size
    memory = (ctypes.c_uint8 * (words * size)).from_address(address or EMPTY)
    memory.block = _Block(address, device, died)  # type: ignore[attr-defined]
    capsule = np.frombuffer(memory, dtype=np.uint8).__dlpack__()
    dl = DLTensor.from_address(_GET_POINTER(capsule, b"dltensor"))
    dev = _DEVICES.get(device)
    if dev is None:
        dev = _DEVICES[device] = DLDevice(EXT_DEV, device)
    dl.device, dl.dtype = dev, dltype
    shape, strides = meta.shape, meta.stride()
    if not meta.storage_offset() and words == _extent(shape, strides):
        # the view spans its storage from its start: the DLTensor carries its sizes and strides
        # (``at::fromDLPack`` copies them; a storage of ``computeStorageNbytes`` bytes: `words`)
        ndim = len(shape)
        dl.ndim, dl.shape, dl.strides = ndim, (ctypes.c_int64 * ndim)(*shape), (ctypes.c_int64 * ndim)(*strides)
        return _FROM_DLPACK(capsule)  # what ``torch.utils.dlpack.from_dlpack`` does with a capsule
    dl.shape[0] = words
    base = _FROM_DLPACK(capsule)
    return _AS_STRIDED._op_dk(_CPU, base, shape, strides, meta.storage_offset())


def _extent(shape: Any, strides: tuple[int, ...]) -> int:
    """Elements from a view's first to one past its last (0 for an empty view)."""
    n = 1
    for size, stride in zip(shape, strides):
        if not size:
            return 0
        n += (size - 1) * stride
    return n
