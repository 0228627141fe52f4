"""``--html FILE``: the self-contained HTML report (`vram.views.html`) of a recording — memory over
the trace with the OOM marked, the segments and the top consumers at the moment `vram explain`
explains (the first OOM, else the reserved peak)."""
from __future__ import annotations

import os
from typing import Any

from vram.units import format_size


def write_report(out: str, path: str, *, device: int | None = None, gpu: int | str | None = None,
                 context: int | str = 0, explanation: Any = None, title: str | None = None) -> None:
    """Write the report of the snapshot at `path` to `out`; `explanation` (a finished
    `vram.analysis.explain.Explanation`) adds its fixes, else only the moment is explained."""
    from vram.analysis.explain import explain
    from vram.analysis.fleet import load_cached
    from vram.replay.engine import replay
    from vram.views.html import render_report
    from vram.views.snapshot import segments

    ex = explanation if explanation is not None else explain(path, device=device, gpu=gpu, context=context,
                                                             fixes=False)
    snap = load_cached(path)
    run = replay(snap, device=ex.device, gpu=gpu, context=context, timeline=True)
    allocated, reserved = run.timeline if run.timeline is not None else ([], [])
    at = ex.at
    stop = at["event_index"] if at["kind"] == "oom" else at["event_index"] + 1
    state = replay(snap, device=ex.device, gpu=gpu, context=context, stop_at=stop)
    moment = (f"at the OOM (event {at['event_index']:,})" if at["kind"] == "oom"
              else f"at the reserved peak (event {at['event_index']:,})")
    marks = [(at["event_index"], "OOM" if at["kind"] == "oom" else "reserved peak",
              "#d62728" if at["kind"] == "oom" else "#333")]
    f = format_size
    facts = [("snapshot", path), ("device", str(ex.device)),
             ("GPU", "no limit" if ex.gpu is None else f"{ex.gpu:,} B ({ex.gpu_from})"),
             ("peak allocated", f(run.peak_allocated)), ("peak reserved", f(run.peak_reserved)),
             ("explained", moment), ("allocated / reserved there", f"{f(ex.allocated)} / {f(ex.reserved)}"),
             ("largest free block there", f(ex.largest_free_block))]
    if at["kind"] == "oom":
        facts.append(("the OOM", at["message"]))
    notes = [*ex.why, *(f"[{'verified' if fix['verified'] else 'fails'}] {fix['change']}" for fix in ex.fixes)]
    page = render_report(title or f"vram: {os.path.basename(path)}", facts, allocated, reserved, marks,
                         segments(state.allocator), moment, ex.top_consumers, notes, limit=ex.gpu)
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(page)
