"""Layer 3: plots of a replay (needs the ``plot`` extra: matplotlib).

`plot_replays` draws memory over the trace — allocated and reserved for the first run, the
reserved line of every other (what-if) run — and, below, a segment map at the first run's
reserved peak: one row per segment, its blocks coloured by state.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GIB = float(1 << 30)
STATE_COLOURS = {"active_allocated": "#1f77b4", "active_pending_free": "#ff7f0e", "inactive": "#d9d9d9"}


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

    fig, (ax, seg_ax) = plt.subplots(2, 1, figsize=(12, 9), gridspec_kw={"height_ratios": [2, 3]})
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

    segs = sorted(peak_segments, key=lambda s: s["address"])
    for row, seg in enumerate(segs):
        for state in STATE_COLOURS:
            spans = []
            offset = 0
            for b in seg["blocks"]:
                if b["state"] == state:
                    spans.append((offset / (1 << 20), b["size"] / (1 << 20)))
                offset += b["size"]
            if spans:
                seg_ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=STATE_COLOURS[state],
                                   edgecolor="none")
    seg_ax.set_xlabel("offset in segment (MiB)")
    seg_ax.set_ylabel("segment (by address)")
    seg_ax.set_ylim(-1, max(len(segs), 1))
    seg_ax.set_title(f"segments at the reserved peak ({label0}, event {ref.reserved_peak_event}): "
                     "blue allocated, orange pending free, grey free")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
