"""The allocator's own invariants, checked on every loaded segment before anything is replayed.

A snapshot that breaks one of these cannot have come from PyTorch's caching allocator, so it is
refused with a one-line error naming the field. Each rule
was checked against the spec, ``c10/cuda/CUDACachingAllocator.cpp`` and the static checks of
spec §23 (0 violations over the 1,216 segments and 3,964 blocks of six real recordings).
Expandable segments (spec §14) are one snapshot entry per mapped run, split at ≥ 512 bytes and
mapped page by page, so only the rules that hold for them too are applied to them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .messages import Invalid, brief, printable

__all__ = ["KNOWN_ACTIONS", "RESERVED_STREAMS", "check_requested", "check_segment", "check_settings",
           "private_pool", "stream_error"]

MiB = 1 << 20
DEFAULT_POOL = (0, 0)  # ``segment_pool_id`` / ``pool_id`` of the default pools
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every block size is a multiple (spec §2, §4)
K_SMALL_SIZE = MiB  # kSmallSize: large-pool blocks are bigger (spec §5, §8)
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: every small segment, and the small-pool page (spec §6, §14)
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: no large segment is smaller (spec §6)
#: every segment base is aligned to at least this: "any address of a variable residing in global
#: memory or returned by one of the memory allocation routines from the driver or runtime API is
#: always aligned to at least 256 bytes" (CUDA C++ Programming Guide, Device Memory Accesses)
SEGMENT_ALIGNMENT = 256
#: Stream ids from here up are the replay's pseudo streams (vram.replay.engine). A recorded
#: stream is ``int64_t(cudaStream_t)``, a user-space pointer (< 2**57 on any 64-bit OS) or a
#: small constant (0 legacy default, 1, 2 per-thread default): never this large.
RESERVED_STREAMS = 1 << 62
#: ``TraceEntry::Action`` names written by ``torch/csrc/cuda/memory_snapshot.cpp`` (and the
#: 2.15 ``annotate`` / ``user_defined`` entries, spec §18.2); anything else is warned about.
KNOWN_ACTIONS = frozenset({"alloc", "free_requested", "free_completed", "segment_alloc",
                           "segment_free", "segment_map", "segment_unmap", "snapshot", "oom",
                           "annotate", "user_defined"})
_ACTIVE = ("active_allocated", "active_pending_free")


def stream_error(path: str, value: int) -> Invalid:
    return Invalid(f"{path} is {value:#x}: stream ids >= 2**62 are reserved for vram's pseudo "
                   "streams (a recorded stream is a user-space cudaStream_t pointer)")


def check_segment(seg: Mapping[str, Any], path: str) -> None:
    """Refuse a normalised segment that PyTorch's allocator cannot produce (see the module doc)."""
    total, small, expandable = seg["total_size"], seg["segment_type"] == "small", seg["is_expandable"]
    if seg["stream"] >= RESERVED_STREAMS:
        raise stream_error(f"{path}.stream", seg["stream"])
    if total % K_MIN_BLOCK_SIZE:
        raise Invalid(f"{path}.total_size is {total}, not a multiple of 512 (spec §2: kMinBlockSize)")
    if seg["address"] % SEGMENT_ALIGNMENT:
        raise Invalid(f"{path}.address is {seg['address']:#x}, not a multiple of {SEGMENT_ALIGNMENT}: "
                      "cudaMalloc and cuMemAddressReserve return addresses aligned to at least that")
    if small and (total % K_SMALL_BUFFER if expandable else total != K_SMALL_BUFFER):
        need = "a multiple of 2 MiB (small pages)" if expandable else "exactly 2 MiB"
        raise Invalid(f"{path} is a {total}-byte segment labelled 'small': small-pool segments are "
                      f"{need} (spec §6, §14)")
    if not small and not expandable and total < K_MIN_LARGE_ALLOC:
        raise Invalid(f"{path} is a {total}-byte segment labelled 'large': large-pool segments are at "
                      "least 10 MiB (spec §6: 20 MiB, or the request rounded up to 2 MiB)")
    prev_free = False
    for j, b in enumerate(seg["blocks"]):
        size, state = b["size"], b["state"]
        if size % K_MIN_BLOCK_SIZE:
            raise Invalid(f"{path}.blocks[{j}].size is {size}, not a multiple of 512 (spec §4)")
        if expandable:
            continue
        if not small and size <= K_SMALL_SIZE:
            raise Invalid(f"{path}.blocks[{j}] is {size} bytes in a large segment: large-pool blocks "
                          "are bigger than 1 MiB (spec §5, §8)")
        free = state == "inactive"
        if free and prev_free:
            raise Invalid(f"{path}.blocks[{j - 1}] and blocks[{j}] are adjacent free blocks: the "
                          "allocator always merges them (spec §10.2)")
        prev_free = free


def check_requested(path: str, requested: int, size: int, state: str) -> None:
    """An allocated or pending block holds at least what was asked (spec §4: requests are
    rounded up). A free block may show more: a remainder keeps the stale value of the block it
    was carved from (spec §8). Only checked where the file gives ``requested_size`` itself
    (legacy blocks without it take ``history[0]``, which may be an older allocation)."""
    if state in _ACTIVE and requested > size:
        raise Invalid(f"{path}.requested_size is {requested}, more than the block's size {size} "
                      "(spec §4: requests are rounded up)")


def check_settings(settings: Mapping[str, Any] | None) -> None:
    """``allocator_settings.PYTORCH_CUDA_ALLOC_CONF`` is the last settings string (spec §18.3)."""
    if settings is None or "PYTORCH_CUDA_ALLOC_CONF" not in settings:
        return
    conf = settings["PYTORCH_CUDA_ALLOC_CONF"]
    if type(conf) is not str:
        raise Invalid(f"allocator_settings.PYTORCH_CUDA_ALLOC_CONF is not a str "
                      f"(got {brief(conf)}): PyTorch records the settings string")
    if len(conf) > 4096:
        raise Invalid(f"allocator_settings.PYTORCH_CUDA_ALLOC_CONF is {len(conf):,} characters long "
                      f"({printable(conf, 40)!r}...)")


def private_pool(pid: Any) -> tuple[int, int] | None:
    """A ``segment_pool_id`` / ``pool_id`` as a private pool's id (a CUDA graph's or a MemPool's),
    or None for the default pools: absent, empty or ``(0, 0)`` (``memory_snapshot.cpp`` writes the
    default as ``(0, 0)``; vram's own snapshots leave it out)."""
    if not pid:
        return None
    pid = tuple(pid)
    return None if pid == DEFAULT_POOL else pid
