"""Layer 2: argument checks of the allocator's public methods, with PyTorch's messages."""
from __future__ import annotations

import operator
from typing import Any


def check_ptr(ptr: Any) -> int:
    if isinstance(ptr, bool) or not isinstance(ptr, int):
        raise TypeError(f"pointer must be an int, got {type(ptr).__name__}")
    return int(ptr)


def check_size(size: Any) -> int:
    if isinstance(size, bool):
        raise TypeError("allocation size must be an int number of bytes, got bool")
    if not isinstance(size, int):
        try:
            size = operator.index(size)
        except TypeError:
            raise TypeError(f"allocation size must be an int number of bytes, got {type(size).__name__}") from None
    if size < 0:
        raise ValueError(f"allocation size must not be negative, got {size}")
    return size


#: A parameter its method validates itself, with PyTorch's messages (a size may be any integer
#: type, a stream a `vram.Stream`): typed Any so that the compiled build (`vram.allocator.native`)
#: does not refuse it first with mypyc's own check of the annotation.
Checked = Any

#: A stream is a ``cudaStream_t`` handle; PyTorch's Python bindings take it as an int64.
STREAM_MAX = 2**63 - 1


def check_stream(stream: Any) -> int:
    """A stream handle: an int in [0, 2**63) or an object with such a ``cuda_stream``."""
    # bool before int, each time: compiled (vram.allocator.native), a value narrowed to int is
    # unboxed, so True would pass as 1.
    if isinstance(stream, bool):
        raise TypeError("stream must be a vram.Stream or an int, got bool")
    s = stream if isinstance(stream, int) else getattr(stream, "cuda_stream", None)
    if isinstance(s, bool) or not isinstance(s, int):
        raise TypeError(f"stream must be a vram.Stream or an int, got {type(stream).__name__}")
    if not 0 <= s <= STREAM_MAX:
        shown = str(s) if -(2**64) < s < 2**64 else f"an int of {s.bit_length()} bits"
        raise ValueError(f"stream must be a stream handle in [0, 2**63), got {shown}")
    return int(s)
