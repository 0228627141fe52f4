"""``--html FILE``: the self-contained HTML report (`vram.views.html`) of a recording — memory over
the trace with the OOM marked, the segments and the top consumers at the moment `vram explain`
explains (the first OOM, else the reserved peak)."""
from __future__ import annotations

import os
import sys
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


def write_whatif_report(out: str, path: str, *, device: int | None = None, gpu: int | str | None = None,
                        context: int | str = 0, conf: str | None = None, cap: int | None = None,
                        title: str | None = None, notes: tuple[str, ...] = ()) -> None:
    """Write the report of one replay of the snapshot at `path` under `conf` (None: the recorded
    config), `gpu` and a per-process `cap`: its memory over the trace, and the segments there and
    the live tensors at its first OOM, else at its reserved peak. Which tensors are live before an
    event does not depend on the config, so they are read from the recorded config's replay, where
    addresses are the recorded ones and each block has its recorded stack."""
    from vram.analysis.explain import consumers
    from vram.analysis.fleet import load_cached
    from vram.replay.engine import UNLIMITED, replay
    from vram.views.html import render_report
    from vram.views.snapshot import segments

    snap = load_cached(path)
    if device is None:  # as explain: the first device with a recorded OOM, else 0
        traces = snap.get("device_traces") or []
        device = next((d for d, t in enumerate(traces) if any(e["action"] == "oom" for e in t)), 0)
    run = replay(snap, device=device, gpu=gpu, context=context, conf=conf, cap=cap, timeline=True)
    allocated, reserved = run.timeline if run.timeline is not None else ([], [])
    oom = run.oom
    at = oom["event_index"] if oom is not None else max(run.reserved_peak_event, 0)
    stop = at if oom is not None else at + 1
    state = replay(snap, device=device, gpu=gpu, context=context, conf=conf, cap=cap, stop_at=stop)
    live = replay(snap, device=device, stop_at=stop)
    moment = f"at the first OOM (event {at:,})" if oom is not None else f"at the reserved peak (event {at:,})"
    f = format_size
    facts = [("snapshot", path), ("device", str(device)),
             ("config", "the recorded one" if conf is None else conf or "(default)"),
             ("GPU", "no limit" if run.gpu >= UNLIMITED else f"{run.gpu:,} B"),
             ("per-process cap", "none" if cap is None else f"{cap:,} B"),
             ("peak allocated", f(run.peak_allocated)), ("peak reserved", f(run.peak_reserved)),
             ("OOMs", f"{run.ooms:,}"), ("shown", moment)]
    if oom is not None:
        facts.append(("the OOM", str(oom.get("message", ""))))
    marks = [(at, "OOM" if oom is not None else "reserved peak", "#d62728" if oom is not None else "#333")]
    assert state.allocator is not None and live.allocator is not None
    page = render_report(title or f"vram replay: {os.path.basename(path)}", facts, allocated, reserved, marks,
                         segments(state.allocator), moment, consumers(snap, device, stop, live.allocator),
                         list(notes), limit=None if run.gpu >= UNLIMITED else run.gpu)
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(page)


def replay_html(args: Any, path: str, cap: int | None) -> None:
    """``vram replay SNAPSHOT --html FILE``: the report of the replay asked for (one config)."""
    if args.conf and len(args.conf) > 1:
        raise ValueError("--html reports one replay: give at most one --conf")
    write_whatif_report(args.html, path, device=args.device, gpu=args.gpu, context=args.context or 0,
                        conf=args.conf[0] if args.conf else None, cap=cap)
    print(f"wrote {args.html}", file=sys.stderr)


def tune_report(out: str, result: Any, device: int | None, top: int) -> None:
    """``vram tune --html``: the report of the best config's replay on the tuned GPU (where none
    fits, the least demanding one's, at its OOM), with the ranked configs below it."""
    from vram.analysis.report import ranked_rows

    chosen = result.best if result.best is not None else (result.least_demanding or result.results[0])
    budget = result.budgets[0]
    notes = [f"rank {k}: peak reserved {peak} ({delta} vs the default), OOM {oom}, {mallocs} cudaMalloc: {conf}"
             for k, peak, delta, oom, mallocs, conf in ranked_rows(result, top)]
    verdict = ("the best config" if result.best is not None else
               "no config fits: the least demanding one, at its first OOM")
    write_whatif_report(out, result.snapshots[0], device=device, gpu=budget.gpu, context=budget.context,
                        conf=chosen["conf"], cap=budget.cap, notes=(verdict, *notes),
                        title=f"vram tune: {os.path.basename(result.snapshots[0])}")
