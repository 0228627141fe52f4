"""A piece of a long recording, as a snapshot of its own (``vram export --from/--to``).

PyTorch's memory_viz page struggles beyond some 600k events. A piece [start, end) of one device's
trace becomes a snapshot that holds those events and, as ``segments``, the allocator's state at
``end`` — as `torch.cuda.memory._snapshot()` would have returned it then. The state comes from
replaying the recording up to ``end`` under its own config, and the cut is refused unless that
replay reproduced the recording exactly up to there (every alloc address and segment), so the
piece is the recording's, not vram's. Blocks keep the stacks of the allocations that made them.
memory_viz (and `vram replay`) rewind a trace from its final segments (spec §18), so the piece
opens as if it had been recorded on its own. A cut never separates a ``segment_alloc`` from the
``alloc`` that made it: the piece's ends move back before such a run.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from vram.views.snapshot import segments as snapshot_segments

from .engine import device_count, replay
from .messages import SnapshotError

_TIME = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|ms|us)\s*$")
_UNIT_US = {"s": 1_000_000, "ms": 1_000, "us": 1}


def event_index(trace: Sequence[Mapping[str, Any]], text: str, what: str) -> int:
    """An event index (``1200``) or a time from the trace's first event (``2.5s``, ``300ms``,
    ``150us``): the index of the first event at or after that time."""
    text = text.strip()
    if text.isdigit():
        index = int(text)
        if index > len(trace):
            raise ValueError(f"{what} {index} is past the trace's {len(trace):,} events")
        return index
    m = _TIME.match(text)
    if m is None:
        raise ValueError(f"{what} {text!r} is neither an event index (1200) nor a time (2.5s, 300ms, 150us)")
    if not trace:
        return 0
    t0 = trace[0].get("time_us")
    if t0 is None:
        raise ValueError(f"{what} {text!r} is a time, but the recording has no event times (time_us): "
                         "give an event index")
    target = t0 + round(float(m.group(1)) * _UNIT_US[m.group(2)])
    return next((k for k, e in enumerate(trace) if (e.get("time_us") or 0) >= target), len(trace))


def allocation_stacks(snap: Mapping[str, Any], trace: Sequence[Mapping[str, Any]], stop: int,
                      device: int) -> dict[int, Sequence[Mapping[str, Any]]]:
    """Recorded address -> the stack of the allocation made there last before event `stop` (blocks
    allocated before the trace began: the stacks the final segments record for them)."""
    frames: dict[int, Sequence[Mapping[str, Any]]] = {}
    for seg in snap.get("segments", []):
        if seg.get("device", 0) == device:
            for b in seg["blocks"]:
                if b.get("frames"):
                    frames[b["address"]] = b["frames"]
    for e in trace[:stop]:
        if e["action"] == "alloc":
            frames[e["addr"]] = e.get("frames") or []
    return frames


def cut(snap: Mapping[str, Any], start: int, end: int, device: int = 0) -> dict[str, Any]:
    """Events [start, end) of `device` and the segments at `end`, in ``_snapshot()``'s shape."""
    from .loader import to_pytorch_snapshot

    n = device_count(snap)
    if not 0 <= device < n:
        raise ValueError(f"device {device} is not in the snapshot: it records {n} device(s) (0..{n - 1})")
    traces = snap.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    if not 0 <= start <= end <= len(trace):
        raise ValueError(f"the piece [{start}, {end}) is not inside the trace's {len(trace):,} events "
                         "(--from must not come after --to)")
    # a segment_alloc belongs with the alloc that made it (the replay acts on the alloc)
    while end > start and trace[end - 1]["action"] == "segment_alloc":
        end -= 1
    while start > 0 and trace[start - 1]["action"] == "segment_alloc":
        start -= 1
    result = replay(snap, device=device, stop_at=end, verify=True)
    v = result.verification or {}
    early = [d for d in v.get("divergences", ()) if d["event_index"] < end and not d["kind"].startswith("final")]
    driver = (("segment_allocs", "segment_alloc"), ("segment_maps", "segment_map"), ("segment_unmaps", "segment_unmap"))
    if (early or v["alloc_addresses"]["matched"] != v["alloc_addresses"]["total"]
            or any(v[k]["matched"] != sum(1 for e in trace[:end] if e["action"] == a) for k, a in driver)):
        first = early[0] if early else {"kind": "segment_alloc", "event_index": "?"}
        raise SnapshotError(f"the replay up to event {end} does not reproduce the recording exactly "
                            f"({first['kind']} at event {first['event_index']}): its state there would "
                            "be vram's, not the recording's; refusing to cut")
    alloc = result.allocator
    assert alloc is not None
    frames = allocation_stacks(snap, trace, end, device)
    segs = snapshot_segments(alloc)
    for s in segs:
        s["device"] = device
        for b in s["blocks"]:
            if b["state"] != "inactive" and not b.get("frames"):
                b["frames"] = frames.get(b["address"], [])
    piece = {**snap, "segments": segs,
             "device_traces": [list(t[start:end]) if d == device else [] for d, t in enumerate(traces)]}
    return to_pytorch_snapshot(piece)
