"""Recordings made on a real H200 (``shared/gpu-truth``, torch 2.11): each replays and verifies
exactly, and its peaks are the ones the GPU measured (``figures.jsonl``).

The expectations are the recordings themselves and the figures `record.py` read from
``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` on the GPU.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from paths import H200, truth_figures, truth_recording
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot

pytestmark = pytest.mark.skipif(not (H200 / "recordings.tar.xz").exists(),
                                reason="needs shared/gpu-truth beside the clone")

COUNTS = ("segment_allocs", "segment_frees", "segment_maps", "segment_unmaps", "alloc_addresses",
          "recorded_ooms", "final_segments", "final_blocks")


def load(name: str, tmp_path: Path) -> dict[str, Any]:
    return load_snapshot(str(truth_recording(name, tmp_path)))


def assert_exact(v: dict[str, Any]) -> None:
    for k in COUNTS:
        assert v[k]["matched"] == v[k]["total"], (k, v[k], v["divergences"][:1])
    assert not v["divergences"]


def test_expandable_segments_recording_verifies_on_a_gpu_of_unknown_size(tmp_path: Path) -> None:
    """Each (stream, pool) reserves ``segment_size × numSegments(total × 9/8)`` (the H200's
    ~157 GiB); the replay GPU defaults to 1 TiB, so its ranges would swallow the recorded ones:
    the side stream's small-pool range was recorded at 0x2a56000000 (its first ``segment_map``),
    inside the 1 TiB range a replay would reserve from the large pool's 0x302000000."""
    snap = load("expandable_pressure", tmp_path)
    maps = [e for e in snap["device_traces"][0] if e["action"] == "segment_map"]
    assert (maps[0]["addr"], maps[1]["addr"]) == (0x302000000, 0x2a56000000)
    fig = truth_figures("expandable_pressure")
    for gpu in (None, "H200"):
        r = replay(snap, gpu=gpu, verify=True)
        assert r.verification is not None
        assert_exact(r.verification)
        assert r.verification["segment_maps"]["total"] == 131
        assert (r.peak_allocated, r.peak_reserved) == (fig["max_allocated"], fig["max_reserved"])
        assert (r.final_allocated, r.final_reserved) == (fig["allocated_end"], fig["reserved_end"])
        assert r.ooms == 16  # the script's caught OOMs (its last line prints num_ooms 16)
