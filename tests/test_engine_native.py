"""The engine's C++ device guard (`vram.run.engine.native`): where it cannot be built, the engine
runs with torch's Python guard and refuses, in one line, what needs it; nothing is rerun."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
DDP_PROGRAM = ROOT / "tests" / "distributed_programs" / "ddp_formulas.py"
SCRIPT = """
import torch
print("before the backward")
a = torch.ones(4, device="cuda:1", requires_grad=True)
(a * 2).sum().backward()
print("after the backward")
"""


def _without_a_compiler(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``vram run --gpu 24GiB ARGS`` with no C++ compiler (``CXX=false``) and an empty cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("VRAM_RUN_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT / "src"), CXX="false", VRAM_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "24GiB", *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))


def test_without_a_compiler_a_backward_on_another_gpu_is_refused_once(tmp_path: Path) -> None:
    """No C++ compiler (``CXX=false``) and an empty cache: PrivateUse1 keeps the Python guard, which
    counts one device (torch/csrc/acc/Module.cpp), so a backward on cuda:1 of a two-GPU process
    has no autograd queue; it is refused in one line naming the build's failure, and the lines
    the script printed before it appear once."""
    script = tmp_path / "two_gpus.py"
    script.write_text(SCRIPT)
    r = _without_a_compiler(tmp_path, "--devices", "2", str(script))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.count("before the backward") == 1 and "after the backward" not in r.stdout
    refusal = [ln for ln in r.stderr.splitlines() if ln.startswith("vram run: a backward on a GPU")]
    assert len(refusal) == 1 and "could not be built" in refusal[0], r.stderr
    assert "Traceback" not in r.stderr and "meta" not in r.stderr


def test_without_a_compiler_a_rank_runs_backward_on_its_own_gpu(tmp_path: Path) -> None:
    """Rank 1 of 2 under DDP (its GPU is ``cuda:LOCAL_RANK`` = cuda:1) with the Python guard: the
    rank's own GPU and engine device 0 trade places (`vram.run.values.known.engine_index`), so its
    backward reaches the one autograd queue and the step runs, charged to cuda:1. The backward
    takes the GPU's in-place formulas (tests/test_subclass_formulas.py's families: 6 + 1 + 1 + 1
    gradient-sized blocks), as with the C++ guard."""
    r = _without_a_compiler(tmp_path, "--nproc-per-node", "2", "--ranks", "1", str(DDP_PROGRAM))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank1]:full 9" in r.stdout.splitlines(), r.stdout
    peak = int(re.findall(r"^\[rank1\]:peak (\d+)$", r.stdout, re.M)[0])
    assert peak > 0 and re.search(r"^\s+1\s+0\s+cuda:1\s+" + f"{peak:,}", r.stdout, re.M), r.stdout
