"""Layer 3: memory snapshots in PyTorch's format (spec §18.3).

`segments(allocator)` is ``torch.cuda.memory_snapshot()`` for one device; `snapshot(allocators)`
is ``torch.cuda.memory._snapshot()``: ``{"segments", "device_traces", "allocator_settings",
"external_annotations"}``, plain Python types only, so a pickle of it opens in PyTorch's own
``torch.cuda._memory_viz``.
"""
from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import Any

from vram.allocator.block import Block
from vram.allocator.caching import CachingAllocator
from vram.allocator.config import allocator_settings

from .output import replaced


def _state(block: Block) -> str:
    if block.allocated:
        return "active_allocated"
    if block.event_count > 0 or block.stream_uses:
        return "active_pending_free"
    return "inactive"


def segments(alloc: CachingAllocator, mempool_id: tuple[int, int] = (0, 0)) -> list[dict[str, Any]]:
    """One dict per segment (per contiguous mapped run for expandable segments), by address;
    with a private pool's id, only that pool's segments (``snapshot(mempool_id)``: the pool's
    head blocks, `CachingAllocator.pool_head_blocks`).

    Also records a ``snapshot`` trace entry whose size is the total active bytes (spec §18.2).
    Frame lists are fresh copies, one per distinct list (blocks that share a stack share the
    copy, as PyTorch's snapshot shares its frames): a replayed file may give one long stack to
    every block, and copying it per block would be quadratic in the file's size.
    """
    index = alloc.device.index
    out: list[dict[str, Any]] = []
    total_active = 0
    copies: dict[int, list[dict[str, Any]]] = {}

    def frames(stack: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        if not stack:
            return []
        got = copies.get(id(stack))
        if got is None:
            got = copies[id(stack)] = list(stack)
        return got

    with alloc.operation(mutates=False):
        private = mempool_id != (0, 0)
        for head in alloc.pool_head_blocks(mempool_id) if private else alloc.all_blocks():
            if head.prev is not None and head.prev.mapped:
                continue
            blocks = []
            total = allocated = active = requested = 0
            b: Block | None = head
            while b is not None and b.mapped:
                state = _state(b)
                blocks.append({"address": b.ptr, "size": b.size, "requested_size": b.requested_size,
                               "state": state, "frames": frames(b.frames)})
                total += b.size
                if state == "active_allocated":
                    allocated += b.size
                if state != "inactive":
                    active += b.size
                    requested += b.requested_size
                b = b.next
            total_active += active
            out.append({
                "device": index, "address": head.ptr, "total_size": total,
                "allocated_size": allocated, "active_size": active, "requested_size": requested,
                "stream": head.stream, "segment_type": "small" if head.pool.is_small else "large",
                "segment_pool_id": head.pool.pool_id, "is_expandable": head.expandable_segment is not None,
                "frames": frames(head.segment_frames), "blocks": blocks,
            })
        out.sort(key=lambda s: s["address"])
        alloc.record_snapshot_entry(total_active, mempool_id if private else None)
    return out


def snapshot(allocators: Iterable[CachingAllocator]) -> dict[str, Any]:
    """``torch.cuda.memory._snapshot()`` over the given devices' allocators, in device order."""
    allocs = sorted(allocators, key=lambda a: a.device.index)
    segs: list[dict[str, Any]] = []
    traces: list[list[dict[str, Any]]] = []
    for a in allocs:
        # Traces are read before the segments: a snapshot's own ``snapshot`` entry shows up in
        # the next snapshot, as in PyTorch.
        with a.operation(mutates=False):  # a finalizer's free meanwhile waits (GC on this thread)
            traces.append([e.as_dict() for e in a.history.entries])
        segs.extend(segments(a))
    settings = allocator_settings(allocs[0].config) if allocs else {}
    return {"segments": segs, "device_traces": traces, "allocator_settings": settings,
            "external_annotations": []}


def dump_snapshot(data: dict[str, Any], filename: str = "dump_snapshot.pickle") -> None:
    """``torch.cuda.memory._dump_snapshot``: pickle the snapshot dict (through a temporary file
    renamed over `filename`: `vram.views.output`)."""
    with replaced(filename, "wb") as f:
        pickle.dump(data, f)
