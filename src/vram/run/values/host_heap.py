"""The host heap of a real-values run: glibc's malloc told to give freed value memory back.

The CPU copies of a real-values run (`vram.run.values.real_values`) and the temporaries of the CPU
kernels that compute them are torch CPU tensors, allocated by glibc's ``malloc``
(c10/core/impl/alloc_cpu.cpp ``alloc_cpu``: ``posix_memalign``). glibc serves a request of at
least ``M_MMAP_THRESHOLD`` bytes (128 KiB at start) by ``mmap``, returned to the system when
freed, but each such free raises the threshold to the freed size, up to 32 MiB
(malloc/malloc.c ``free``: "dynamic mmap threshold"; ``DEFAULT_MMAP_THRESHOLD_MAX``), so later
tensors up to that size come from the heap, whose freed chunks are kept for reuse and fragment:
a training run's changing activation sizes leave most of them unused and never returned (the
heap held more free bytes than live value copies within a few steps of a detection model).

`give_back_freed` sets the threshold, which turns the dynamic one off (``mallopt``: setting
``M_MMAP_THRESHOLD`` or ``M_TRIM_THRESHOLD`` sets ``no_dyn_threshold``): every tensor of at
least `MMAP_THRESHOLD` bytes is mapped on its own and unmapped when freed. Elsewhere than glibc
(no ``mallopt``) nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["MMAP_THRESHOLD", "give_back_freed"]

#: malloc.h's parameter numbers
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: requests of at least this many bytes are mapped on their own (glibc's starting threshold)
MMAP_THRESHOLD = 128 << 10
#: the heap's free top above this is returned to the system (glibc's starting value)
TRIM_THRESHOLD = 128 << 10
_SET: list[bool] = []


def give_back_freed() -> bool:
    """Fix glibc's mmap and trim thresholds at their starting values for the rest of the process
    (once); False where the C library has no ``mallopt``."""
    if _SET:
        return _SET[0]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _SET.append(False)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _SET.append(done)
    return done
