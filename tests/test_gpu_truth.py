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
from vram.replay.messages import SnapshotError

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


def test_cuda_graphs_and_mempool_recording_without_trace_pool_ids_verifies(tmp_path: Path) -> None:
    """torch 2.11 writes no pool id on trace entries: the pools of the 9 segments freed in the
    trace (warm-up on a side stream, the graphs' pool, the MemPool, the RNG's per-graph seed and
    offset in the default pool) are not in the file. Every assignment of pools that reproduces the
    recording does so event for event, so it verifies, with the peaks the GPU measured; a what-if
    whose answer may depend on the assignment is refused, naming a segment whose pool would settle it."""
    snap = load("graphs_pools", tmp_path)
    assert not any("pool_id" in e for e in snap["device_traces"][0])
    fig = truth_figures("graphs_pools")
    r = replay(snap, verify=True)
    assert r.verification is not None
    assert_exact(r.verification)
    assert r.verification["alloc_addresses"]["total"] == 76 and r.verification["segment_frees"]["total"] == 9
    assert (r.peak_allocated, r.peak_reserved) == (fig["max_allocated"], fig["max_reserved"])
    assert (r.final_allocated, r.final_reserved) == (fig["allocated_end"], fig["reserved_end"])
    assert any("reproduce it event for event" in c for c in r.caveats)
    # the MemPool's four tensors (graphs_pools.py line 24): 4 MiB and 12 MiB in one new 20 MiB
    # segment, 4000 B in a new small one, 16 MiB in a 16 MiB segment of its own
    trace = snap["device_traces"][0]
    mempool = [i for i, e in enumerate(trace) if e["action"] == "alloc" and e["frames"]
               and e["frames"][0]["filename"].endswith("graphs_pools.py") and e["frames"][0]["line"] == 24]
    assert [trace[i]["size"] for i in mempool] == [4 << 20, 12 << 20, 4000, 16 << 20]
    with pytest.raises(SnapshotError, match=r"what-if may differ between them: which pool the segment at 0x[0-9a-f]+ "
                                            r"\(allocated at event \d+, freed at event \d+\) belonged to"):
        replay(snap, gpu="H100")


def test_a_what_if_under_a_per_process_cap_is_what_the_capped_gpu_did(tmp_path: Path) -> None:
    """expandable_pressure.py capped itself at 2 GiB with ``set_per_process_memory_fraction(2 GiB
    / total)`` on the H200 (``figures.jsonl``'s ``total``). Replayed as a what-if (recorded OOMs
    not forced) under that fraction of that total, the cap alone fails the same 16 requests, and
    peaks and end state are the GPU's. A cap is not a smaller card: ``alloc_block`` checks the
    whole ``alloc_size`` against the cap, while a card refuses only the pages a map lacks."""
    snap = load("expandable_pressure", tmp_path)
    fig = truth_figures("expandable_pressure")
    fraction = 2 * 2**30 / fig["total"]
    r = replay(snap, gpu=fig["total"], conf=f"expandable_segments:True,per_process_memory_fraction:{fraction!r}")
    recorded_ooms = [i for i, e in enumerate(snap["device_traces"][0]) if e["action"] == "oom"]
    assert [o["event_index"] for o in r.oom_events] == recorded_ooms and r.ooms == fig["num_ooms"] == 16
    assert (r.peak_allocated, r.peak_reserved) == (fig["max_allocated"], fig["max_reserved"])
    assert (r.final_allocated, r.final_reserved) == (fig["allocated_end"], fig["reserved_end"])
    maps = sum(e["action"] == "segment_map" for e in snap["device_traces"][0])
    unmaps = sum(e["action"] == "segment_unmap" for e in snap["device_traces"][0])
    assert (r.segment_allocs, r.segment_frees) == (maps, unmaps)
    card = replay(snap, gpu=2 * 2**30, conf="expandable_segments:True")
    assert (card.segment_allocs, card.segment_frees) != (maps, unmaps)


def test_the_cap_a_real_oom_ran_into_lies_in_the_bracket_the_recording_gives(tmp_path: Path) -> None:
    """expandable_pressure.py's first OOM came from its 2 GiB cap (134.95 GiB of the H200 free):
    the cap lies between the most reserved before it and reserved + the segment it refused."""
    from vram.analysis.tune import cap_bound
    snap = load("expandable_pressure", tmp_path)
    fig = truth_figures("expandable_pressure")
    oom = replay(snap).oom
    assert oom is not None and oom["recorded"] and oom["device_free"] > 100 * 2**30
    high = cap_bound(oom)
    assert high is not None
    low = replay(snap, stop_at=oom["event_index"]).peak_reserved
    cap = int(2 * 2**30 / fig["total"] * float(fig["total"]))  # allowed_memory_maximum
    assert low <= cap <= high
    assert replay(snap, cap=high, conf="expandable_segments:True").oom_events[0]["event_index"] == oom["event_index"]


def test_vram_replay_cap_is_the_per_process_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from vram.cli.commands import main
    path = truth_recording("expandable_pressure", tmp_path)
    fig = truth_figures("expandable_pressure")
    assert main(["replay", str(path), "--cap", "2GiB", "--conf", "expandable_segments:True", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["ooms"], out["peak_reserved"], out["final_reserved"]) == (16, fig["max_reserved"], fig["reserved_end"])
