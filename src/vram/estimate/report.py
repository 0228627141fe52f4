"""The text report of a `vram.estimate.EstimateResult` (``str(result)``, ``vram estimate``)."""
from __future__ import annotations

from typing import Any

from vram.devices.nccl import with_nccl
from vram.units import format_size

_LABELS = {"parameters": "parameters", "buffers": "buffers", "gradients": "gradients",
           "optimizer_state": "optimizer state", "activations": "activations (saved for backward)",
           "temporaries": "temporaries", "cublas_workspaces": "cuBLAS workspaces",
           "cache_fragmentation": "cached, unallocated (reserved - allocated)",
           "all_gather_buffers": "all-gather buffers (unsharded parameters)",
           "reduce_scatter_buffers": "reduce-scatter buffers", "ddp_buckets": "DDP gradient buckets"}
_PHASE_LABELS = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    out = ["  " + header[0].ljust(widths[0]) + "".join("  " + h.rjust(w) for h, w in zip(header[1:], widths[1:]))]
    for r in rows:
        out.append("  " + r[0].ljust(widths[0]) + "".join("  " + c.rjust(w) for c, w in zip(r[1:], widths[1:])))
    return out


def _block_notes(blocks: dict[str, int], requested: dict[str, int]) -> list[str]:
    """Why a category's bytes can exceed its tensors' (gradients above parameters): the figures are
    allocator blocks, as ``memory_allocated()`` counts them; a cached block is handed out whole when
    splitting would leave at most 1 MiB (large pool: ``should_split``, spec §4), besides the
    512-byte rounding. Noted where that adds more than 1% and 64 KiB to a category."""
    out = []
    for k, v in blocks.items():
        asked = requested.get(k)
        if asked and k not in ("temporaries", "cache_fragmentation") and v - asked > max(v / 100, 65536):
            out.append(f"  {_LABELS[k]}: {format_size(v)} of allocator blocks hold {format_size(asked)} of tensors")
    if out:
        out += ["  (the table counts allocator blocks, as memory_allocated() does: a cached block is handed out",
                "  whole when splitting would leave <= 1 MiB, so gradients can exceed the parameters they match)"]
    return out


def render(r: Any, top_modules: int = 10, nccl: int | None = 0) -> str:
    """The report of one estimate; `nccl`: a rank's NCCL memory outside the caching allocator
    (`vram.devices.nccl`), added to nvidia-smi's figures (None: not derived)."""
    s = r.settings
    smi = with_nccl(r.peak_device_used, nccl)
    smi_text = format_size(smi) if smi is not None else "not derived (NCCL's share unknown)"
    smi_what = "reserved + context + NCCL + others" if nccl else "reserved + context + others"
    its = s["iterations"]
    steady = f"iterations 2-{its}" if its > 2 else ("iteration 2" if its == 2 else "iteration 1 only")
    lines = [f"vram estimate: {r.model_name}, {r.parameters_count:,} parameters"
             + (f"; inputs {', '.join(r.inputs)}" if r.inputs else ""),
             f"  optimizer {s['optimizer'] or 'none'}, amp {s['amp'] or 'off'}, checkpoint "
             f"{'on' if s['checkpoint'] else 'off'}, grad_accum {s['grad_accum']}"
             + (", custom step" if s.get("custom_step") else "")
             + (f", torch.compile {s['compile']}" if s.get("compile") else "")
             + f"; {its} iteration{'s' if its != 1 else ''} (steady state: {steady})"]
    card = s.get("gpu_name", "")
    card = f" {card}," if card and not card.endswith("(simulated by vram)") else ""
    arch = f", sm_{s['arch'].replace('.', '')}" if s.get("arch") else ""
    gpu = f"GPU{card} {format_size(r.gpu)}{arch}, CUDA context {format_size(r.context)}" + (
        f", allocator conf {s['conf']!r}" if s.get("conf") else "")
    if r.fits:
        pct = f" ({100.0 * smi / r.gpu:.1f}% of the GPU)" if r.gpu and smi is not None else ""
        lines.append(f"  {gpu}: fits, nvidia-smi peak {smi_text}{pct}")
    else:
        o = r.oom or {}
        lines.append(f"  {gpu}: DOES NOT FIT (out of memory in iteration {o.get('iteration')}, "
                     f"{o.get('phase')}); the figures below are what the step needs")
    lines.append("")
    rows = []
    for ph in ("forward", "backward", "optimizer"):
        f, st = r.phases["first"].get(ph), r.phases["steady"].get(ph)
        if f is None and st is None:
            continue
        rows.append([_PHASE_LABELS[ph]] + [format_size(d[k]) if d else "-" for d in (f, st)
                                           for k in ("peak_allocated", "peak_reserved")])
    rows.append(["whole step", format_size(r.first_peak_allocated), format_size(r.first_peak_reserved),
                 format_size(r.peak_allocated), format_size(r.peak_reserved)])
    lines += _table(rows, ["peak per phase", "first: allocated", "reserved",
                           "steady: allocated", "reserved"])
    lines.append(f"  nvidia-smi at the steady-state peak ({smi_what}): {smi_text}")
    lines.append(f"  kept between steps (allocated after the last step): {format_size(r.resident)}")
    lines.append("")
    at = r.peak_at
    phase = _PHASE_LABELS.get(at["phase"], at["phase"])
    lines.append(f"at the steady-state peak (iteration {at['iteration']}, {phase}):")
    total = sum(r.categories.values())
    labels = dict(_LABELS, parameters="parameters (this rank's: shards, stage)") if "layout" in s else _LABELS
    rows = [[labels[k], format_size(v), f"{100.0 * v / total:.1f}%" if total else "-"]
            for k, v in r.categories.items()]
    rows.append(["reserved at that moment", format_size(total), ""])
    lines += _table(rows, ["category", "bytes", "share"])
    lines += _block_notes(r.categories, getattr(r, "categories_requested", {}))
    if r.by_module:
        lines += ["", "activations at the peak by module (innermost module whose forward allocated them):"]
        items = list(r.by_module.items())
        rows = [[name, r.module_types.get(name, ""), format_size(v)] for name, v in items[:top_modules]]
        if len(items) > top_modules:
            rest = items[top_modules:]
            rows.append([f"({len(rest)} more modules)", "", format_size(sum(v for _, v in rest))])
        lines += _table(rows, ["module", "class", "bytes"])
    return "\n".join(lines)
