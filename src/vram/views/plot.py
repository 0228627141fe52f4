"""Layer 3: plots of a replay (needs the ``plot`` extra: matplotlib).

`plot_replays` draws memory over the trace — allocated and reserved for the first run, the
reserved line of every other (what-if) run — and, below, a segment map at the first run's
reserved peak: one row per segment, its blocks coloured by state.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .output import replaced

GIB = float(1 << 30)
MIB = float(1 << 20)
#: Up to this many segments the map has a row per segment; beyond, segments are laid end to end
#: (by address) and wrapped into this many rows of equal width, so every row stays visible.
MAX_ROWS = 200
STATE_COLOURS = {"active_allocated": "#1f77b4", "active_pending_free": "#ff7f0e", "inactive": "#d9d9d9"}


def segment_rows(segments: Sequence[dict[str, Any]], max_rows: int = MAX_ROWS) -> list[list[tuple[str, int, int]]]:
    """The segment map's rows: (state, start, size) spans; ("boundary", x, 0) marks where one
    segment ends and the next begins in a packed row. A row per segment up to `max_rows`
    segments; beyond, the segments laid end to end wrapped into `max_rows` rows of equal width
    (a whole number of MiB), a block that crosses a row's end continuing on the next."""
    segs = sorted(segments, key=lambda s: s["address"])
    if len(segs) <= max_rows:
        rows = []
        for seg in segs:
            offset, spans = 0, []
            for b in seg["blocks"]:
                spans.append((b["state"], offset, b["size"]))
                offset += b["size"]
            rows.append(spans)
        return rows
    total = sum(b["size"] for seg in segs for b in seg["blocks"])
    width = -(-total // max_rows)
    width = -(-width // (1 << 20)) * (1 << 20)
    rows = [[] for _ in range(-(-total // width))]
    pos = 0
    for k, seg in enumerate(segs):
        if k and pos % width:
            rows[pos // width].append(("boundary", pos % width, 0))
        for b in seg["blocks"]:
            left = b["size"]
            while left:
                row, col = divmod(pos, width)
                piece = min(left, width - col)
                rows[row].append((b["state"], col, piece))
                pos += piece
                left -= piece
    return rows


def plot_replays(runs: Sequence[tuple[str, Any]], peak_segments: Sequence[dict[str, Any]],
                 out: str, title: str = "") -> None:
    """Write a PNG (or any format matplotlib knows from `out`'s suffix).

    `runs`: (label, ReplayResult with a timeline) pairs, the first being the reference run.
    `peak_segments`: the reference run's snapshot segments at its reserved peak.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("vram plot needs matplotlib: pip install 'vram[plot]'") from e

    rows = segment_rows(peak_segments)
    map_height = max(4.0, min(len(rows), MAX_ROWS) * 0.045)  # >= ~5 px per row at 110 dpi
    fig, (ax, seg_ax) = plt.subplots(2, 1, figsize=(12, 5 + map_height),
                                     gridspec_kw={"height_ratios": [5, map_height]})
    label0, ref = runs[0]
    allocated, reserved = ref.timeline
    xs = range(len(allocated))
    ax.fill_between(xs, [a / GIB for a in allocated], step="post", alpha=0.35, color="#1f77b4",
                    label=f"allocated ({label0})")
    ax.step(xs, [r / GIB for r in reserved], where="post", color="#1f77b4", lw=1.6,
            label=f"reserved ({label0})")
    for k, (label, run) in enumerate(runs[1:]):
        res = run.timeline[1]
        ax.step(range(len(res)), [r / GIB for r in res], where="post", lw=1.2, ls="--",
                color=f"C{k + 1}", label=f"reserved ({label})")
        if run.oom is not None:
            ax.axvline(run.oom["event_index"], color=f"C{k + 1}", lw=0.8, ls=":")
    if ref.reserved_peak_event >= 0:
        ax.axvline(ref.reserved_peak_event, color="black", lw=0.6, ls=":")
    ax.set_xlabel("trace event")
    ax.set_ylabel("GiB")
    ax.set_title(title or "memory over the trace")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)

    for row, spans in enumerate(rows):
        for state, colour in STATE_COLOURS.items():
            mine = [(start / MIB, size / MIB) for s, start, size in spans if s == state]
            if mine:
                seg_ax.broken_barh(mine, (row - 0.4, 0.8), facecolors=colour, edgecolor="none")
        for s, start, _ in spans:
            if s == "boundary":
                seg_ax.plot([start / MIB] * 2, [row - 0.45, row + 0.45], color="black", lw=0.5)
    packed = len(peak_segments) > MAX_ROWS
    seg_ax.set_xlabel("offset in row (MiB): segments laid end to end by address, black lines between them"
                      if packed else "offset in segment (MiB)")
    seg_ax.set_ylabel("row" if packed else "segment (by address)")
    seg_ax.set_ylim(len(rows), -1)
    seg_ax.set_title(f"{len(peak_segments):,} segments at the reserved peak ({label0}, event "
                     f"{ref.reserved_peak_event}): blue allocated, orange pending free, grey free")
    fig.tight_layout()
    fmt = os.path.splitext(os.fspath(out))[1][1:].lower() or None
    with replaced(out, "wb") as f:  # (savefig takes the format from a path's suffix, not a file's)
        fig.savefig(f, dpi=110, format=fmt)
    plt.close(fig)
