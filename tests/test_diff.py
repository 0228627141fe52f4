"""`vram diff A B`: two snapshots' request sequences aligned, unmatched requests by
the frame that made them, the first divergence, peaks side by side. The cases are built from a
real recording by removing or adding known requests, so the expected alignment is known."""
from __future__ import annotations

import copy
from typing import Any

from paths import RECORDINGS  # noqa: E402
from vram.replay.diff import compare, render, side, user_frame
from vram.replay.loader import load_snapshot

TRACE = RECORDINGS / "cs336-s-mem.pickle"


def _allocs(snap: dict[str, Any]) -> list[int]:
    return [i for i, e in enumerate(snap["device_traces"][0]) if e["action"] == "alloc"]


def test_a_recording_against_itself_is_identical() -> None:
    snap = load_snapshot(TRACE)
    r = compare(side("real", snap), side("copy", snap))
    assert r.identical and r.matched == 36 and r.segments_matched == 9 and r.first is None
    assert r.a.peak_allocated == r.b.peak_allocated and "identical" in render(r)


def test_a_missing_request_is_found_with_its_frame() -> None:
    real = load_snapshot(TRACE)
    sim = copy.deepcopy(real)
    trace = sim["device_traces"][0]
    k = _allocs(sim)[14]          # the 15th request: remove its alloc and its free events
    addr = trace[k]["addr"]
    removed = trace[k]
    sim["device_traces"][0] = [e for i, e in enumerate(trace) if not (
        i == k or (i > k and e["addr"] == addr and e["action"] in ("free_requested", "free_completed")
                   and all(x["addr"] != addr or x["action"] != "alloc" for x in trace[k + 1:i])))]
    a, b = side("real", real), side("sim", sim)
    r = compare(a, b)
    assert (r.matched, sum(r.only_a.values()), sum(r.only_b.values())) == (35, 1, 0)
    frame = user_frame(removed["frames"])
    assert r.only_a == {frame: 1} and r.only_a_bytes == {frame: removed["size"]}
    assert r.first is not None and (r.first.index_a, r.first.size_a, r.first.size_b) == (14, removed["size"], None)
    j = r.to_json()
    assert j["only_a"] == [{"frame": frame, "requests": 1, "bytes": removed["size"]}] and not j["identical"]
    text = render(r)
    assert "only in real" in text and "first divergence: real request #14" in text


def test_frames_from_a_file_are_printed_safely() -> None:
    frames = [{"filename": "/x/\x1b]0;owned\x07evil.py", "line": 3, "name": "f\x1b[2J"}]
    shown = user_frame(frames)
    assert "\x1b" not in shown and "\x07" not in shown and "evil.py:3" in shown


def test_a_stack_without_python_frames_is_named_by_what_allocated_not_by_the_unwinder() -> None:
    # a ``stacks="all"`` stack of an allocation on the autograd engine's thread, innermost first:
    # the capture (torch/csrc/profiler/unwind), the allocator, the factory, the op, the node
    cpp = ["torch::unwind::unwind()", "torch::CapturedTraceback::gather(bool, bool, bool)",
           "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, "
           "CUstream_st*)", "at::detail::empty_generic(c10::ArrayRef<long>, c10::Allocator*)",
           "at::native::mm(at::Tensor const&, at::Tensor const&)",
           "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)",
           "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"]
    frames = [{"filename": "??", "line": 0, "name": n} for n in cpp]
    assert user_frame(frames) == "(no Python frame) autograd backward: MmBackward0"
    assert user_frame(frames[:5]) == "(no Python frame) at::native::mm(at::Tensor const&, at::Tensor const&)"
    assert user_frame(frames[:2]) == "(no Python frame)"
