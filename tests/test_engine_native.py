"""The engine's C++ device guard (`vram.run.engine.native`): where it cannot be built, the engine
runs with torch's Python guard and refuses, in one line, what needs it; nothing is rerun."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import torch
print("before the backward")
a = torch.ones(4, device="cuda:1", requires_grad=True)
(a * 2).sum().backward()
print("after the backward")
"""


def test_without_a_compiler_a_backward_on_another_gpu_is_refused_once(tmp_path: Path) -> None:
    """No C++ compiler (``CXX=false``) and an empty cache: PrivateUse1 keeps the Python guard, which
    counts one device (torch/csrc/acc/Module.cpp), so a backward on cuda:1 of a two-GPU process
    has no autograd queue; it is refused in one line naming the build's failure, and the lines
    the script printed before it appear once."""
    script = tmp_path / "two_gpus.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("VRAM_RUN_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT / "src"), CXX="false", VRAM_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "24GiB", "--devices", "2", str(script)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.count("before the backward") == 1 and "after the backward" not in r.stdout
    refusal = [ln for ln in r.stderr.splitlines() if ln.startswith("vram run: a backward on a GPU")]
    assert len(refusal) == 1 and "could not be built" in refusal[0], r.stderr
    assert "Traceback" not in r.stderr and "meta" not in r.stderr
