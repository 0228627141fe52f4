"""Layer 3: a self-contained HTML report of a replay: one file, inline SVG and CSS, no script and
nothing fetched from the network, so it opens in any browser, offline.

`render_report` draws memory over the trace (allocated filled, reserved as a line; the OOM and
the reserved peak marked), the segment map at the moment explained (blocks coloured by state,
as `vram.views.plot` draws it), and the top consumers (live bytes by the user's stack frame).
"""
from __future__ import annotations

from collections.abc import Sequence
from html import escape
from typing import Any

from vram.units import format_size

from .plot import STATE_COLOURS, segment_rows

#: points per line in the memory chart: longer traces keep each bucket's maximum (peaks stay visible)
MAX_POINTS = 1200
WIDTH, HEIGHT, PAD = 900, 260, 56
#: room left of the memory chart for its byte labels ("1024.00 MiB")
LEFT = 88
ROW_HEIGHT = 6

_CSS = """body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;max-width:980px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}table{border-collapse:collapse}
td,th{padding:2px 10px 2px 0;text-align:left;vertical-align:top}th{white-space:nowrap}
td.n{text-align:right;white-space:nowrap}
.bar{background:#1f77b4;height:10px}.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;
vertical-align:middle}code{font-size:13px}svg text{font:11px system-ui,sans-serif;fill:#444}"""


def _downsample(values: Sequence[int], points: int = MAX_POINTS) -> list[tuple[int, int]]:
    """(event, value) pairs, at most about `points`: each bucket of events keeps its maximum."""
    n = len(values)
    if n <= points:
        return list(enumerate(values))
    step = -(-n // points)
    out = []
    for start in range(0, n, step):
        chunk = values[start:start + step]
        k = max(range(len(chunk)), key=chunk.__getitem__)
        out.append((start + k, chunk[k]))
    return out


def memory_svg(allocated: Sequence[int], reserved: Sequence[int], marks: Sequence[tuple[int, str, str]],
               limit: int | None = None) -> str:
    """Memory over the trace as SVG; `marks` are (event, label, colour) vertical lines; `limit`
    (bytes PyTorch could have) a horizontal line."""
    n = max(len(reserved), 1)
    top = max([*reserved, *allocated, limit or 0, 1])
    w, h = WIDTH - LEFT - PAD, HEIGHT - 2 * PAD

    def x(event: int) -> float:
        return LEFT + w * event / max(n - 1, 1)

    def y(value: int) -> float:
        return PAD + h - h * value / top

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img" '
             f'aria-label="memory over the trace">',
             f'<rect x="{LEFT}" y="{PAD}" width="{w}" height="{h}" fill="#fafafa" stroke="#ccc"/>']
    for k in range(5):
        v = top * k // 4
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#e5e5e5"/>'
                     f'<text x="{LEFT - 4}" y="{y(v) + 4:.1f}" text-anchor="end">{escape(format_size(v))}</text>')
    alloc_pts = _downsample(allocated)
    if alloc_pts:
        poly = " ".join(f"{x(e):.1f},{y(v):.1f}" for e, v in alloc_pts)
        parts.append(f'<polygon points="{x(alloc_pts[0][0]):.1f},{y(0):.1f} {poly} {x(alloc_pts[-1][0]):.1f},'
                     f'{y(0):.1f}" fill="#1f77b4" fill-opacity="0.35"><title>allocated</title></polygon>')
    res_pts = _downsample(reserved)
    if res_pts:
        poly = " ".join(f"{x(e):.1f},{y(v):.1f}" for e, v in res_pts)
        parts.append(f'<polyline points="{poly}" fill="none" stroke="#1f77b4" stroke-width="1.6">'
                     f'<title>reserved</title></polyline>')
    if limit:
        parts.append(f'<line x1="{LEFT}" x2="{LEFT + w}" y1="{y(limit):.1f}" y2="{y(limit):.1f}" stroke="#d62728" '
                     f'stroke-dasharray="2,3"><title>the GPU: {escape(format_size(limit))}</title></line>')
    for event, label, colour in marks:
        parts.append(f'<line x1="{x(event):.1f}" x2="{x(event):.1f}" y1="{PAD}" y2="{PAD + h}" stroke="{colour}" '
                     f'stroke-width="1.5" stroke-dasharray="4,3"><title>{escape(label)}</title></line>'
                     f'<text x="{x(event) + 3:.1f}" y="{PAD - 6}" fill="{colour}">{escape(label)}</text>')
    parts.append(f'<text x="{LEFT + w / 2:.0f}" y="{HEIGHT - 14}" text-anchor="middle">trace event (0 .. '
                 f'{n - 1:,})</text></svg>')
    return "".join(parts)


def segments_svg(segments: Sequence[dict[str, Any]]) -> str:
    """The segment map: a row per segment (packed rows beyond `vram.views.plot.MAX_ROWS`), blocks
    coloured by state; each block's size and state in its tooltip."""
    rows = segment_rows(segments)
    widest = max((start + size for spans in rows for _, start, size in spans), default=1) or 1
    w = WIDTH - 2 * PAD
    height = max(len(rows), 1) * ROW_HEIGHT + 4
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" role="img" '
             f'aria-label="segments">']
    for r, spans in enumerate(rows):
        top = r * ROW_HEIGHT + 2
        for state, start, size in spans:
            left = PAD + w * start / widest
            if state == "boundary":
                parts.append(f'<line x1="{left:.2f}" x2="{left:.2f}" y1="{top}" y2="{top + ROW_HEIGHT - 1}" '
                             'stroke="black" stroke-width="0.6"/>')
                continue
            parts.append(f'<rect x="{left:.2f}" y="{top}" width="{max(w * size / widest, 0.3):.2f}" '
                         f'height="{ROW_HEIGHT - 1}" fill="{STATE_COLOURS.get(state, "#999")}">'
                         f'<title>{escape(state)} {escape(format_size(size))}</title></rect>')
    parts.append("</svg>")
    return "".join(parts)


def consumers_table(consumers: Sequence[dict[str, Any]]) -> str:
    """The top consumers: bytes, blocks and the stack frame, with a bar per row."""
    if not consumers:
        return "<p>no live tensors</p>"
    most = max(c["bytes"] for c in consumers) or 1
    rows = "".join(
        f'<tr><td class="n">{escape(format_size(c["bytes"]))}</td><td class="n">{c["blocks"]:,}</td>'
        f'<td style="width:160px"><div class="bar" style="width:{100 * c["bytes"] / most:.1f}%"></div></td>'
        f'<td><code>{escape(str(c["frame"]))}</code></td></tr>' for c in consumers)
    head = "<tr><th>bytes</th><th>blocks</th><th></th><th>where (the user's stack frame)</th></tr>"
    return f"<table>{head}{rows}</table>"


def render_report(title: str, facts: Sequence[tuple[str, str]], allocated: Sequence[int],
                  reserved: Sequence[int], marks: Sequence[tuple[int, str, str]],
                  segments: Sequence[dict[str, Any]], segments_caption: str,
                  consumers: Sequence[dict[str, Any]], notes: Sequence[str] = (),
                  limit: int | None = None) -> str:
    """The whole page: `facts` (name, value) first, then the three pictures, then `notes`."""
    legend = "".join(f'<span style="background:{c}"></span>{escape(s.replace("_", " "))}'
                     for s, c in STATE_COLOURS.items())
    fact_rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in facts)
    note_items = "".join(f"<li>{escape(n)}</li>" for n in notes)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{_CSS}</style></head><body><h1>{escape(title)}</h1><table>{fact_rows}</table>"
            f"<h2>Memory over the trace</h2><p>allocated (filled) and reserved (line), in bytes as "
            f"<code>torch.cuda.memory_allocated()</code> / <code>memory_reserved()</code> report them.</p>"
            f"{memory_svg(allocated, reserved, marks, limit)}"
            f"<h2>Segments {escape(segments_caption)}</h2><p class=\"legend\">{legend}</p>{segments_svg(segments)}"
            f"<h2>Top consumers {escape(segments_caption)}</h2>{consumers_table(consumers)}"
            + (f"<h2>Notes</h2><ul>{note_items}</ul>" if notes else "")
            + "<p><small>vram: a self-contained report (no scripts, nothing fetched).</small></p></body></html>\n")
