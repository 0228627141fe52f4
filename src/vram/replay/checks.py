"""Event-by-event comparison of a replay with its recording (``vram replay --verify``): every
``alloc`` address, recorded ``oom``, ``segment_alloc`` / ``segment_free`` / map / unmap (address,
size, order) and the final segments and blocks (address, size, state, ``requested_size``)."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from vram.allocator.caching import CachingAllocator
from vram.devices.trace import TraceDevice
from vram.views.snapshot import segments as snapshot_segments

from .messages import printable
from .validate import KNOWN_ACTIONS, private_pool


class Checks:
    """Event-by-event comparison with the recording (verification mode). `rare`: the indices of
    the events whose action is none of alloc, free_requested, free_completed, segment_alloc
    (`vram.replay.ccore.Scan.rare`), the only ones read here; None: every event is read."""

    def __init__(self, trace: Sequence[Mapping[str, Any]], rare: Sequence[int] | None = None) -> None:
        self.trace = trace
        n = len(trace)
        self.rare: Sequence[Mapping[str, Any]] = trace if rare is None else [trace[i] for i in rare if i < n]
        self.allocs_total = 0
        self.allocs_matched = 0
        self.ooms_matched = 0  # recorded OOMs that failed in the replay too
        self.ooms_total = 0
        self.divergences: list[dict[str, Any]] = []
        self.notes: list[str] = []  # what the replay could not reproduce exactly
        self.unknown_actions: dict[str, int] = {}  # events vram does not know: not replayed
        for e in self.rare:
            if e["action"] == "oom":
                self.ooms_total += 1
            elif e["action"] not in KNOWN_ACTIONS:
                self.unknown_actions[e["action"]] = self.unknown_actions.get(e["action"], 0) + 1

    def note(self, i: int, kind: str, expected: Any, actual: Any) -> None:
        if len(self.divergences) < 10:
            lo, hi = max(0, i - 3), min(len(self.trace), i + 4)
            context = [f"{'>' if k == i else ' '} {k}: {_describe(self.trace[k])}" for k in range(lo, hi)]
            self.divergences.append({"kind": kind, "event_index": i, "expected": expected,
                                     "actual": actual, "context": context})

    def alloc(self, i: int, addr: int, ours: int | None) -> None:
        self.allocs_total += 1
        if ours == addr:
            self.allocs_matched += 1
        else:
            self.note(i, "alloc_address", _hex(addr), _hex(ours) if ours is not None else "OOM")

    def frees_of_no_live_block(self, live_at_start: Collection[int]) -> None:
        """Note each ``free_requested`` of an address where the recording has no live block then
        (never allocated, or freed already): PyTorch records one only when ``free()`` is called
        on a live block (CUDACachingAllocator.cpp, ``free``: ``record_trace(FREE_REQUESTED, ...)``),
        so such a trace was not written by it as it stands and its replay is not called exact.
        `live_at_start`: the blocks allocated (or pending) when the trace begins."""
        live = set(live_at_start)
        stray, first = 0, -1
        for i, e in enumerate(self.trace):
            action = e["action"]
            if action == "alloc":
                live.add(e["addr"])
            elif action == "free_requested":
                if e["addr"] in live:
                    live.discard(e["addr"])
                    continue
                stray += 1
                first = i if first < 0 else first
                if not any(d["event_index"] == i and d["kind"] == "free" for d in self.divergences):
                    self.note(i, "free", "a live block", "none at that address")
        if stray:
            self.notes.append(f"{stray:,} free_requested event(s) (the first: event {first:,}) free an address "
                              "with no live block in the recording (never allocated, or freed already): "
                              "not as PyTorch records frees, so not verified")

    def finish(self, alloc: CachingAllocator, dev: TraceDevice, final: Sequence[Mapping[str, Any]],
               recorded: Sequence[tuple[int, int]], live_at_start: Collection[int] = ()) -> dict[str, Any]:
        self.frees_of_no_live_block(live_at_start)
        ours = [(a, s) for a, s, _ in dev.mallocs]
        seg_matched = sum(1 for x, y in zip(ours, recorded) if x == y)
        rec_frees = [(e["addr"], e["size"]) for e in self.rare if e["action"] == "segment_free"]
        free_matched = sum(1 for x, y in zip(dev.frees, rec_frees) if x == y)
        maps = _matched(self.rare, "segment_map", dev.maps)
        unmaps = _matched(self.rare, "segment_unmap", dev.unmaps)
        mine = snapshot_segments(alloc)
        want_segs = {(s["address"], s["total_size"], private_pool(s.get("segment_pool_id"))) for s in final}
        have_segs = {(s["address"], s["total_size"], private_pool(s.get("segment_pool_id"))) for s in mine}
        want_blocks = {_block_key(s, b) for s in final for b in _with_addresses(s)}
        have_blocks = {_block_key(s, b) for s in mine for b in _with_addresses(s)}
        missing = sorted(want_blocks - have_blocks)[:5]
        extra = sorted(have_blocks - want_blocks)[:5]
        for b in missing:
            self.note(len(self.trace) - 1, "final_block_missing", _fmt_block(b), None)
        for b in extra:
            self.note(len(self.trace) - 1, "final_block_unexpected", None, _fmt_block(b))
        return {
            "segment_allocs": {"matched": seg_matched, "total": max(len(recorded), len(ours))},
            "segment_frees": {"matched": free_matched, "total": max(len(rec_frees), len(dev.frees))},
            "segment_maps": maps,
            "segment_unmaps": unmaps,
            "alloc_addresses": {"matched": self.allocs_matched, "total": self.allocs_total},
            "recorded_ooms": {"matched": self.ooms_matched, "total": self.ooms_total},
            "final_segments": {"matched": len(want_segs & have_segs),
                               "total": len(want_segs | have_segs)},
            "final_blocks": {"matched": len(want_blocks & have_blocks),
                             "total": len(want_blocks | have_blocks)},
            "unknown_actions": self.unknown_actions,
            "notes": self.notes,
            "divergences": self.divergences,
        }


def _matched(events: Sequence[Mapping[str, Any]], action: str, ours: Sequence[tuple[int, int]]) -> dict[str, int]:
    """Recorded `action` events (address, size) equal to ours, in order."""
    rec = [(e["addr"], e["size"]) for e in events if e["action"] == action]
    return {"matched": sum(1 for x, y in zip(ours, rec) if x == y), "total": max(len(rec), len(ours))}


def _with_addresses(seg: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    out: list[Mapping[str, Any]] = []
    addr = seg["address"]
    for b in seg["blocks"]:
        out.append({**b, "address": b.get("address", addr)})
        addr += b["size"]
    return out


def _block_key(seg: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[int, int, str, int]:
    return (b["address"], b["size"], b["state"], b.get("requested_size", 0))


def _fmt_block(b: tuple[int, int, str, int]) -> str:
    return f"{b[0]:#x} size {b[1]} {b[2]} requested {b[3]}"


def _hex(x: int) -> str:
    return f"{x:#x}"


def _describe(e: Mapping[str, Any]) -> str:
    where = e.get("addr", e.get("device_free", 0))
    return f"{printable(e['action'], 64)} {where:#x} size {e['size']} stream {e.get('stream', 0)}"
