"""Layer 4: tensor-like buffers with Python reference semantics.

A `Tensor` is a view (shape, dtype, element offset) of a `Storage`; the storage owns one block
of the simulated GPU's caching allocator and frees it into the cache the moment the last
reference to it — from any tensor or view — dies, exactly when PyTorch's would (CPython frees on
the last reference; a reference cycle waits for the garbage collector, as with torch). So the
classic experiments behave as on a GPU: ``x = vram.empty(n)`` repeated keeps at most two blocks
live (the new one is allocated before the name is rebound), an alias keeps memory alive after
``del``, and ``vram.empty_cache()`` returns only whole free segments.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

from vram.allocator.caching import CachingAllocator

from . import memory as _memory


class dtype:
    """A tensor element type: name and bytes per element (``torch.dtype``)."""

    __slots__ = ("name", "itemsize", "is_floating_point")

    def __init__(self, name: str, itemsize: int, is_floating_point: bool) -> None:
        self.name = name
        self.itemsize = itemsize
        self.is_floating_point = is_floating_point

    def __repr__(self) -> str:
        return f"vram.{self.name}"


_DTYPE_TABLE = [
    ("float32", 4, True, ("float",)), ("float64", 8, True, ("double",)),
    ("float16", 2, True, ("half",)), ("bfloat16", 2, True, ()),
    ("float8_e4m3fn", 1, True, ()), ("float8_e5m2", 1, True, ()),
    ("complex64", 8, False, ("cfloat",)), ("complex128", 16, False, ("cdouble",)),
    ("int64", 8, False, ("long",)), ("int32", 4, False, ("int",)), ("int16", 2, False, ("short",)),
    ("int8", 1, False, ()), ("uint8", 1, False, ()), ("bool", 1, False, ()),
]
DTYPES: dict[str, dtype] = {}
for _name, _size, _fp, _aliases in _DTYPE_TABLE:
    _dt = dtype(_name, _size, _fp)
    for _alias in (_name,) + _aliases:
        DTYPES[_alias] = _dt


def as_dtype(value: Any) -> dtype:
    """A dtype from a `dtype`, a name ("float16", "torch.float16", "half") or a torch.dtype."""
    if isinstance(value, dtype):
        return value
    name = value if isinstance(value, str) else str(value)
    name = name.removeprefix("torch.").removeprefix("vram.")
    try:
        return DTYPES[name]
    except KeyError:
        raise TypeError(f"unknown dtype {value!r}; known: {', '.join(sorted(DTYPES))}") from None


_INT64_MAX = 2**63 - 1


def _as_shape(shape: Iterable[Any]) -> tuple[int, ...]:
    """A shape as ``torch.empty`` parses it: ints (bools count as ints inside a sequence),
    int64-sized, none negative; PyTorch's messages for the rest."""
    out: list[int] = []
    for pos, d in enumerate(shape, 1):
        try:
            d = operator.index(d)
        except TypeError:
            raise TypeError(f"empty(): argument 'size' failed to unpack the object at pos {pos} with error "
                            f"\"type must be tuple of ints,but got {type(d).__name__}\"") from None
        if not -_INT64_MAX - 1 <= d <= _INT64_MAX:
            raise TypeError(f"empty(): argument 'size' failed to unpack the object at pos {pos} with error "
                            "\"Overflow when unpacking long long\"")
        if d < 0:
            raise RuntimeError(f"Trying to create tensor with negative dimension {d}: {out + [d]}")
        out.append(int(d))
    return tuple(out)


class Storage:
    """One allocation of a simulated GPU; freed into the cache when the last reference dies."""

    __slots__ = ("_ptr", "_nbytes", "allocator", "device_index", "__weakref__")

    def __init__(self, nbytes: int, allocator: CachingAllocator, stream: int) -> None:
        self._ptr = 0
        self.allocator = allocator
        self.device_index = allocator.device.index
        self._nbytes = nbytes
        self._ptr = allocator.malloc(nbytes, stream)

    def nbytes(self) -> int:
        return self._nbytes

    def data_ptr(self) -> int:
        return self._ptr

    def __del__(self) -> None:
        ptr, self._ptr = self._ptr, 0
        if ptr:
            self.allocator.free(ptr)


class Tensor:
    """A strided-free view of a `Storage`: enough of ``torch.Tensor`` to reason about memory."""

    __slots__ = ("_storage", "_shape", "_dtype", "_offset", "__weakref__")

    def __init__(self, storage: Storage, shape: tuple[int, ...], dt: dtype, offset: int = 0) -> None:
        self._storage = storage
        self._shape = shape
        self._dtype = dt
        self._offset = offset  # in elements

    # -- torch.Tensor-like attributes ------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def size(self, dim: int | None = None) -> Any:
        return self._shape if dim is None else self._shape[dim]

    @property
    def dtype(self) -> dtype:
        return self._dtype

    @property
    def device(self) -> str:
        return f"cuda:{self._storage.device_index}"

    is_cuda = True

    def dim(self) -> int:
        return len(self._shape)

    ndim = property(dim)

    def numel(self) -> int:
        return math.prod(self._shape)

    def element_size(self) -> int:
        return self._dtype.itemsize

    @property
    def itemsize(self) -> int:
        return self._dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self._dtype.itemsize

    def data_ptr(self) -> int:
        ptr = self._storage.data_ptr()
        return ptr + self._offset * self._dtype.itemsize if ptr else 0

    def untyped_storage(self) -> Storage:
        return self._storage

    def record_stream(self, stream: Any) -> None:
        """``Tensor.record_stream``: the memory is in use on `stream`; its free waits for it."""
        ptr = self._storage.data_ptr()
        if ptr:
            self._storage.allocator.record_stream(ptr, stream)

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __repr__(self) -> str:
        return (f"vram.Tensor(shape={self._shape}, dtype={self._dtype.name}, device='{self.device}', "
                f"data_ptr={self.data_ptr():#x})")

    # -- views: share the storage --------------------------------------------------------------
    def view(self, *shape: Any) -> Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        dims = list(shape)
        numel = self.numel()
        if dims.count(-1) > 1:
            raise RuntimeError("only one dimension can be inferred")
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            if known == 0 or numel % known:
                raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}")
            dims[dims.index(-1)] = numel // known
        new_shape = _as_shape(dims)
        if math.prod(new_shape) != numel:
            raise RuntimeError(f"shape '{list(shape)}' is invalid for input of size {numel}")
        return Tensor(self._storage, new_shape, self._dtype, self._offset)

    reshape = view

    def flatten(self) -> Tensor:
        return self.view(-1)

    def detach(self) -> Tensor:
        return Tensor(self._storage, self._shape, self._dtype, self._offset)

    def __getitem__(self, index: Any) -> Tensor:
        """Basic indexing along the first dimension (an int or a step-1 slice) is a view."""
        if not self._shape:
            raise IndexError("invalid index of a 0-dim tensor")
        n, rest = self._shape[0], self._shape[1:]
        inner = math.prod(rest)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                raise NotImplementedError("only step-1 slices are supported")
            length = max(0, stop - start)
            return Tensor(self._storage, (length,) + rest, self._dtype, self._offset + start * inner)
        i = operator.index(index)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of bounds for dimension 0 with size {n}")
        i %= n
        return Tensor(self._storage, rest, self._dtype, self._offset + i * inner)

    # -- new memory ------------------------------------------------------------------------
    def clone(self) -> Tensor:
        return empty(self._shape, dtype=self._dtype, device=self._storage.device_index)

    def to(self, dtype: Any) -> Tensor:
        dt = as_dtype(dtype)
        if dt is self._dtype:
            return self
        return empty(self._shape, dtype=dt, device=self._storage.device_index)


def _parse_size_args(size: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """Split ``empty(2, 3)`` / ``empty((2, 3), "float16")`` arguments into (shape, rest)."""
    if size and isinstance(size[0], (tuple, list)):
        return _as_shape(size[0]), size[1:]
    if size and (isinstance(size[0], bool) or not hasattr(size[0], "__index__")):
        raise TypeError(f"empty(): argument 'size' (position 1) must be tuple of ints, not {type(size[0]).__name__}")
    n = 0
    while n < len(size) and not isinstance(size[n], (str, dtype)) and hasattr(size[n], "__index__"):
        n += 1
    if n < len(size) and isinstance(size[n], (float, complex)):  # a size list with a float in it
        _as_shape(size[:n + 1])
    return _as_shape(size[:n]), size[n:]


def empty(*size: Any, dtype: Any = "float32", device: Any = None, stream: Any = None) -> Tensor:
    """``torch.empty(shape, dtype=..., device="cuda")`` on a simulated GPU.

    ``empty((1024, 1024))``, ``empty(1024, 1024)`` and ``empty((4,), "float16")`` all work; the
    block comes from the device's caching allocator on `stream` (default: the current stream).
    """
    shape, rest = _parse_size_args(size)
    if len(rest) > 3:
        raise TypeError("empty() takes a shape, then at most dtype, device and stream")
    positional = dict(zip(("dtype", "device", "stream"), rest))
    dt = as_dtype(positional.get("dtype", dtype))
    device = positional.get("device", device)
    stream = positional.get("stream", stream)
    idx = _memory._device_index(device)
    allocator = _memory.get_allocator(idx)
    if stream is None:
        stream = _memory.current_stream(idx)
    stream_id = stream.cuda_stream if isinstance(stream, _memory.Stream) else stream
    storage = Storage(math.prod(shape) * dt.itemsize, allocator, stream_id)
    return Tensor(storage, shape, dt)


def empty_like(t: Tensor, dtype: Any = None) -> Tensor:
    return empty(t.shape, dtype=dtype or t.dtype, device=t.device)


# Values are not simulated: these allocate exactly like torch's factories of the same name.
zeros = ones = rand = randn = empty
zeros_like = ones_like = empty_like
