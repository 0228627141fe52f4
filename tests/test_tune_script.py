"""``vram tune -- script.py args`` (the script recorded once under ``vram run``,
then tuned) and ``vram explain`` on a ``vram run`` dump — each answer checked by a replay of its own."""
from __future__ import annotations

import json
import pickle

import pytest

from vram.cli.commands import main
from vram.replay.engine import replay
from vram.replay.loader import load_snapshot

torch = pytest.importorskip("torch")

MiB = 1 << 20


def test_tune_a_script_records_it_once_and_ranks_the_confs(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text("import torch\n"
                      "a = torch.empty(60 * 2**20, dtype=torch.uint8, device='cuda')\n"
                      "del a\n"
                      "b = torch.empty(30 * 2**20, dtype=torch.uint8, device='cuda')\n"
                      "c = torch.empty(50 * 2**20, dtype=torch.uint8, device='cuda')\n")
    assert main(["tune", "--gpu", "1GiB", "--json", "--jobs", "1", "--", str(script)]) == 0
    out = json.loads(capfd.readouterr().out)
    best = out["best"]
    assert best["oom"] is False and out["results"]
    # the recording's own peak: 60 MiB then 50 MiB more (30 reuses the cached 60): 110 MiB; the
    # best conf is no worse, and it heads the ranking
    assert best["peak_reserved"] <= 110 * MiB
    assert min(r["peak_reserved"] for r in out["results"] if not r["oom"]) == best["peak_reserved"]


def test_explain_on_a_vram_run_dump(tmp_path):
    from vram.analysis.explain import explain
    from vram.run.runtime import simulated_cuda
    path = tmp_path / "run.pickle"
    with simulated_cuda(gpu="24GiB"):
        torch.cuda.memory._record_memory_history()
        a = torch.empty(60 * MiB, dtype=torch.uint8, device="cuda")
        del a
        b = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")  # noqa: F841
        c = torch.empty(50 * MiB, dtype=torch.uint8, device="cuda")  # noqa: F841
        torch.cuda.memory._dump_snapshot(str(path))
    ex = explain(str(path), gpu="100MiB", workers=1).to_json()
    # on 100 MiB: the 60 MiB segment holds b, 60 + 50 > 100: the 50 MiB request fails
    assert ex["at"]["kind"] == "oom" and ex["at"]["size"] == 50 * MiB
    assert ex["reserved_unallocated"] == 30 * MiB and ex["largest_free_block"] == 30 * MiB
    snap = load_snapshot(pickle.dumps(pickle.loads(path.read_bytes())))
    for fix in ex["fixes"]:
        if fix["kind"] == "config" and fix["verified"]:
            conf = fix["change"].split("=", 1)[1]
            assert replay(snap, gpu="100MiB", conf=conf).ooms == 0
        if fix["kind"] == "empty_cache":
            assert replay(snap, gpu="100MiB", empty_cache_at=(fix["event_index"],)).ooms == 0
    assert any(f["kind"] == "empty_cache" for f in ex["fixes"])
