"""``vram diff A B``: where two snapshots of one program part ways.

Typically A is a real GPU's recording and B a `vram run` dump of the same program (or two
recordings under different settings). Each side is reduced to its sequence of allocation
request sizes (trace ``alloc`` events, in order) and of new segments (``segment_alloc`` /
``segment_map`` sizes); the sequences are aligned (longest matching blocks, `difflib`), and the
unmatched requests are grouped by the user's stack frame that made them. Peaks come from
replaying each side under its own recorded config on an unlimited GPU (`vram.replay.engine`).
The first divergence is the first request where the alignment does not match, with the frames
of both sides.
"""
from __future__ import annotations

import difflib
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .engine import replay
from .messages import printable

#: Frames of these files are library frames; the user frame is the innermost other Python frame.
_LIBRARY_MARKS = ("/torch/", "\\torch\\", "/vram/", "\\vram\\", "<frozen", "/site-packages/", "\\site-packages\\")
_NEW_SEGMENT = ("segment_alloc", "segment_map")


def user_frame(frames: Sequence[Mapping[str, Any]]) -> str:
    """``file:line in name`` of the innermost Python frame outside torch/vram/site-packages;
    else the innermost Python frame; else ``"?"``."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    for f in python:
        if not any(mark in str(f.get("filename", "")) for mark in _LIBRARY_MARKS):
            return _where(f)
    if python:
        return _where(python[0])
    return _cpp_frame(frames) if frames else "?"


#: innermost C++ frames of a ``stacks="all"`` recording that are the stack capture, the
#: allocator and the empty-tensor factories: they are in every stack, so they say nothing
_MACHINERY = ("torch::unwind::", "torch::CapturedTraceback", "torch::(anonymous namespace)::gather", "c10::",
              "std::", "at::detail::empty", "at::native::empty", "at::empty", "at::_ops::empty", "at::cuda::empty")
#: an autograd node's ``apply`` (``torch/csrc/autograd/generated/Functions.cpp``): the backward op
_BACKWARD_NODE = re.compile(r"torch::autograd::generated::(\w+)::apply")


def _cpp_frame(frames: Sequence[Mapping[str, Any]]) -> str:
    """A stack without Python frames (an allocation on a C++ thread, such as the autograd
    engine's): the backward node that allocated, else the innermost frame past the capture and
    allocator machinery (``torch::unwind::unwind()`` tops every such stack)."""
    names = [str(f.get("name", "")) for f in frames]
    for name in names:
        node = _BACKWARD_NODE.search(name)
        if node:
            return printable(f"(no Python frame) autograd backward: {node.group(1)}", 300)
    for name in names:
        if name and not name.startswith(_MACHINERY) and name != "??":
            return printable(f"(no Python frame) {name}", 300)
    return "(no Python frame)"


def _where(f: Mapping[str, Any]) -> str:
    """A frame as ``file:line in name``, safe to print (names come from untrusted files)."""
    return printable(f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}", 300)


@dataclass
class Side:
    """One snapshot's allocation requests, new segments and peaks."""

    name: str
    sizes: list[int]
    frames: list[Sequence[Mapping[str, Any]]]
    segments: list[int]
    peak_allocated: int
    peak_reserved: int


def side(name: str, snapshot: Mapping[str, Any], device: int = 0) -> Side:
    """`snapshot`'s (a loaded snapshot) requests, new segments and peaks on `device`."""
    result = replay(snapshot, device=device)  # also refuses a device the snapshot does not have
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    allocs = [e for e in trace if e["action"] == "alloc"]
    return Side(name, [e["size"] for e in allocs], [e.get("frames") or [] for e in allocs],
                [e["size"] for e in trace if e["action"] in _NEW_SEGMENT],
                result.peak_allocated, result.peak_reserved)


@dataclass
class Divergence:
    index_a: int
    index_b: int
    size_a: int | None
    size_b: int | None
    frames_a: list[str]
    frames_b: list[str]


@dataclass
class DiffResult:
    a: Side
    b: Side
    matched: int
    only_a: Counter[str] = field(default_factory=Counter)        # user frame -> requests
    only_a_bytes: Counter[str] = field(default_factory=Counter)
    only_b: Counter[str] = field(default_factory=Counter)
    only_b_bytes: Counter[str] = field(default_factory=Counter)
    segments_matched: int = 0
    first: Divergence | None = None

    @property
    def identical(self) -> bool:
        return self.first is None and self.a.segments == self.b.segments

    def to_json(self) -> dict[str, Any]:
        def group(counts: Counter[str], sizes: Counter[str]) -> list[dict[str, Any]]:
            return [{"frame": f, "requests": n, "bytes": sizes[f]} for f, n in counts.most_common()]
        return {
            "a": {"name": self.a.name, "requests": len(self.a.sizes), "segments": len(self.a.segments),
                  "peak_allocated": self.a.peak_allocated, "peak_reserved": self.a.peak_reserved},
            "b": {"name": self.b.name, "requests": len(self.b.sizes), "segments": len(self.b.segments),
                  "peak_allocated": self.b.peak_allocated, "peak_reserved": self.b.peak_reserved},
            "matched": self.matched, "segments_matched": self.segments_matched,
            "identical": self.identical,
            "only_a": group(self.only_a, self.only_a_bytes), "only_b": group(self.only_b, self.only_b_bytes),
            "first_divergence": None if self.first is None else self.first.__dict__,
        }


def _frames(frames: Sequence[Mapping[str, Any]], limit: int = 6) -> list[str]:
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")] or list(frames)
    return [_where(f) for f in python[:limit]]


def _matched(a: Sequence[int], b: Sequence[int]) -> tuple[int, list[Any]]:
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    ops = matcher.get_opcodes()
    return sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag == "equal"), ops


def compare(a: Side, b: Side) -> DiffResult:
    """Align `a`'s and `b`'s request sequences (and new-segment sequences)."""
    matched, ops = _matched(a.sizes, b.sizes)
    result = DiffResult(a, b, matched, segments_matched=_matched(a.segments, b.segments)[0])
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        if result.first is None:
            result.first = Divergence(i1, j1, a.sizes[i1] if i1 < i2 else None, b.sizes[j1] if j1 < j2 else None,
                                      _frames(a.frames[i1]) if i1 < i2 else [],
                                      _frames(b.frames[j1]) if j1 < j2 else [])
        for i in range(i1, i2):
            frame = user_frame(a.frames[i])
            result.only_a[frame] += 1
            result.only_a_bytes[frame] += a.sizes[i]
        for j in range(j1, j2):
            frame = user_frame(b.frames[j])
            result.only_b[frame] += 1
            result.only_b_bytes[frame] += b.sizes[j]
    return result


def render(r: DiffResult, top: int = 10) -> str:
    """The text report of `vram diff`."""
    a, b = r.a, r.b
    numbers = (len(a.sizes), len(b.sizes), a.peak_allocated, b.peak_allocated, a.peak_reserved, b.peak_reserved)
    w = max(len(a.name), len(b.name), *(len(f"{n:,}") for n in numbers))
    lines = [f"{'':<24}{a.name:>{w}}  {b.name:>{w}}",
             f"{'allocation requests':<24}{len(a.sizes):>{w},}  {len(b.sizes):>{w},}",
             f"{'new segments':<24}{len(a.segments):>{w},}  {len(b.segments):>{w},}",
             f"{'peak allocated':<24}{a.peak_allocated:>{w},}  {b.peak_allocated:>{w},}",
             f"{'peak reserved':<24}{a.peak_reserved:>{w},}  {b.peak_reserved:>{w},}", ""]
    longest = max(len(a.sizes), len(b.sizes), 1)
    lines.append(f"requests matched in order: {r.matched:,} ({100 * r.matched / longest:.1f}% of the longer "
                 f"sequence); only in {a.name}: {sum(r.only_a.values()):,}; only in {b.name}: "
                 f"{sum(r.only_b.values()):,}")
    lines.append(f"new segments matched in order: {r.segments_matched:,} of {max(len(a.segments), len(b.segments)):,}")
    if r.identical:
        lines.append("identical: every request and every new segment, in order")
        return "\n".join(lines)
    for name, counts, sizes in ((a.name, r.only_a, r.only_a_bytes), (b.name, r.only_b, r.only_b_bytes)):
        if counts:
            lines.append(f"\nonly in {name}, by the frame that asked (requests, bytes):")
            lines += [f"  {n:>6,}  {sizes[f]:>15,}  {f}" for f, n in counts.most_common(top)]
            if len(counts) > top:
                lines.append(f"  ... {len(counts) - top} more frames")
    if r.first is not None:
        d = r.first
        lines.append(f"\nfirst divergence: {a.name} request #{d.index_a:,} "
                     f"({'none' if d.size_a is None else f'{d.size_a:,} B'}) vs {b.name} request "
                     f"#{d.index_b:,} ({'none' if d.size_b is None else f'{d.size_b:,} B'})")
        for name, frames in ((a.name, d.frames_a), (b.name, d.frames_b)):
            if frames:
                lines.append(f"  {name} stack (innermost first):")
                lines += [f"    {f}" for f in frames]
    return "\n".join(lines)
