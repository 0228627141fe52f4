"""torchtitan's own training entry point, unmodified, under ``vram run --nproc-per-node 8``
. Needs a torchtitan checkout (not part of vram) named by ``VRAM_TORCHTITAN``, with
its dependencies importable (torchdata, datasets, tyro, triton) and ``tests/assets/c4_test``
present; skipped otherwise. docs/estimate-accuracy.md (distributed) says which commit was used.

torchtitan logs ``memory: X GiB`` per step from ``torch.cuda.memory_stats()``'s
``reserved_bytes.all.peak`` and resets the peak after each log
(``torchtitan/components/metrics.py``, ``DeviceMemoryMonitor``): those figures must be vram's
allocator's, and the largest of them the run's peak reserved in vram's table."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TITAN = os.environ.get("VRAM_TORCHTITAN")
ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30

pytestmark = pytest.mark.skipif(not TITAN or not (Path(TITAN) / "torchtitan" / "train.py").is_file(),
                                reason="VRAM_TORCHTITAN does not name a torchtitan checkout")


def test_torchtitan_debug_model_trains_on_8_simulated_gpus() -> None:
    assert TITAN is not None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), TITAN]),
               PYTORCH_ALLOC_CONF="expandable_segments:True")   # as torchtitan's run_train.sh
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "H100", "--nproc-per-node", "8",
                        "--ranks", "0", "torchtitan/train.py", "--job.config_file",
                        "torchtitan/models/llama3/train_configs/debug_model.toml", "--training.steps", "3"],
                       capture_output=True, text=True, env=env, cwd=TITAN, timeout=900)
    out = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
    assert r.returncode == 0, out[-4000:]
    logged = [float(g) for g in re.findall(r"step: +\d+ .*memory: +([\d.]+)GiB", out)]
    assert len(logged) == 3
    row = re.search(r"^ +0 +0 +cuda:0 +[\d,]+ \([^)]*\) +([\d,]+) ", out, re.M)
    assert row is not None
    assert max(logged) == round(int(row[1].replace(",", "")) / GiB, 2)
