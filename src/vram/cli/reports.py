"""Text the snapshot commands print: the replay report (``vram replay``), the allocation trial
(``--alloc``), a trace's extent (``vram export``'s errors) and how ``vram diff`` names its files."""
from __future__ import annotations

import os
from typing import Any

from vram.units import format_size


def shown(text: Any, limit: int = 200) -> str:
    """Text from a file, safe to print: control characters escaped, at most `limit` chars."""
    from vram.replay.messages import printable

    return printable(str(text), limit)


def label(conf: str) -> str:
    return conf if conf else "default config"


def try_alloc(result: Any, size: int) -> dict[str, Any]:
    from vram.allocator.errors import OutOfMemoryError

    alloc = result.allocator
    try:
        ptr = alloc.malloc(size)
    except OutOfMemoryError as e:
        return {"size": size, "ok": False, "message": str(e)}
    alloc.free(ptr)
    return {"size": size, "ok": True, "message": None}


def replay_report(path: str, snap: dict[str, Any], results: list[Any], trials: list[dict[str, Any]] | None) -> str:
    from vram.replay.engine import UNLIMITED

    r0 = results[0]
    lines = [f"{shown(path)}: {r0.events:,} events replayed ({snap['format']}"
             f"{', legacy format' if snap.get('legacy') else ''}), GPU "
             f"{'not limited (--gpu sets one)' if r0.gpu >= UNLIMITED else format_size(r0.gpu)}, "
             f"context {format_size(r0.context)}"]
    rows = [
        ("config", lambda r: label(r.conf)),
        ("peak allocated", lambda r: format_size(r.peak_allocated)),
        ("peak reserved", lambda r: format_size(r.peak_reserved)),
        ("peak nvidia-smi (reserved + context)", lambda r: format_size(r.peak_device_used)),
        ("reserved - allocated at reserved peak", lambda r: format_size(r.fragmentation_at_reserved_peak)),
        ("largest free block at reserved peak", lambda r: "not known (see notes)"
         if r.largest_free_block_at_reserved_peak is None else format_size(r.largest_free_block_at_reserved_peak)),
        ("segment allocations (cudaMalloc/map)", lambda r: f"{r.segment_allocs:,}"),
        ("segment frees (cudaFree/unmap)", lambda r: f"{r.segment_frees:,}"),
        ("cudaMalloc retries", lambda r: f"{r.alloc_retries:,}"),
        ("OOMs", lambda r: f"{r.ooms:,}" if r.oom is None else f"{r.ooms:,} (first: event {r.oom['event_index']:,})"),
        ("replay time", lambda r: f"{r.seconds_replay:.2f} s" + (
            f" ({r.skipped_events:,} events in repeated periods)" if r.skipped_events else "")),
    ]
    width = max(len(name) for name, _ in rows) + 2
    cells = [[fn(r) for r in results] for _, fn in rows]
    if trials:
        rows.append(("then allocate " + format_size(trials[0]["size"]), label))
        cells.append(["succeeds" if t["ok"] else "OOM" for t in trials])
    colw = [max(len(c[k]) for c in cells) + 2 for k in range(len(results))]
    lines.append("")
    for (name, _), vals in zip(rows, cells):
        lines.append(name.ljust(width) + "".join(v.rjust(w) for v, w in zip(vals, colw)))
    for r in results:
        if r.oom is not None:
            lines += ["", f"[{shown(label(r.conf))}] OOM at event {r.oom['event_index']:,}:", r.oom["message"]]
            frames = [f for f in r.oom["frames"] if f.get("line")][:6]
            if frames:
                lines.append("recorded stack (innermost first):")
                lines += [f"  {shown(f['filename'])}:{f['line']} in {shown(f['name'])}" for f in frames]
    for r in results:
        if r.caveats:
            lines += [""] + [f"note [{shown(label(r.conf))}]: {note}" for note in r.caveats]
    if trials:
        for r, t in zip(results, trials):
            if not t["ok"]:
                lines += ["", f"[{shown(label(r.conf))}] allocating {format_size(t['size'])} now fails:",
                          t["message"]]
    for r in results:
        if r.verification is not None:
            lines += ["", "verification against the recording:"]
            for key, name in (("segment_allocs", "segment_alloc (size, order, address)"),
                              ("segment_frees", "segment_free (address, size, order)"),
                              ("segment_maps", "segment_map (address, size, order)"),
                              ("segment_unmaps", "segment_unmap (address, size, order)"),
                              ("alloc_addresses", "alloc addresses"),
                              ("recorded_ooms", "OOMs (same event, recorded free memory)"),
                              ("final_segments", "final segments"), ("final_blocks", "final blocks")):
                m, t = r.verification[key]["matched"], r.verification[key]["total"]
                if key in ("segment_maps", "segment_unmaps") and not t:
                    continue  # no expandable segments: nothing to say
                pct = 100.0 * m / t if t else 100.0
                lines.append(f"  {name:<40} {m:>8,} / {t:<8,} {pct:6.2f}%")
            unknown = r.verification.get("unknown_actions") or {}
            if unknown:
                names = ", ".join(f"'{shown(a, 24)}' x{c:,}" for a, c in sorted(unknown.items())[:5])
                lines.append(f"  not replayed: {sum(unknown.values()):,} events with unknown actions ({names})")
            others = r.verification.get("segments_on_other_devices", 0)
            if others:
                lines.append(f"  not verified: {others:,} segments on other devices (see --device)")
            lines += [f"  note: {note}" for note in r.verification.get("notes", ())]
            for d in r.verification["divergences"][:5]:
                lines += [f"  divergence ({d['kind']}) at event {d['event_index']}: expected "
                          f"{d['expected']}, got {d['actual']}"] + [f"      {c}" for c in d["context"]]
    return "\n".join(lines)


def trace_extent(trace: list[dict[str, Any]]) -> str:
    """How long a device's trace is, in events and (when recorded) in time from its first event."""
    times = [e.get("time_us") for e in (trace[0], trace[-1])] if trace else []
    span = (f", {(times[1] - times[0]) / 1e6:.6g} s from the first to the last"
            if len(times) == 2 and None not in times else "")
    return f"the recording has {len(trace):,} events (0..{len(trace) - 1:,}){span}"


def side_names(a: str, b: str) -> tuple[str, str]:
    """How `vram diff` names its two files: the basenames, or, when those are the same, the
    shortest trailing parts of the paths that tell them apart (``A:`` / ``B:`` when even the full
    paths are equal)."""
    pa, pb = os.path.normpath(a).split(os.sep), os.path.normpath(b).split(os.sep)
    for k in range(1, max(len(pa), len(pb)) + 1):
        na, nb = os.sep.join(pa[-k:]), os.sep.join(pb[-k:])
        if na != nb:
            return na, nb
    return f"A:{pa[-1]}", f"B:{pb[-1]}"
