"""FSDP2 (``fully_shard``) on simulated GPUs (issue 13), checked against PyTorch's own tracker.

`tests/distributed_programs/fsdp2_mlp.py` is an ordinary FSDP2 training script. Run by
``vram run --nproc-per-node 2`` it prints ``max_memory_allocated()`` over a warmed-up baseline;
run with ``--tracker`` it is rank 0 of 2 on the CPU with PyTorch's fake process group, under
``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, the way PyTorch's
``test/distributed/_tools/test_fsdp2_mem_tracker.py`` measures it.

The two count the same tensors but for the optimizer's ``step`` counters: Adam keeps them on the
host unless ``capturable``/``fused`` (``torch/optim/adam.py``, ``_init_group``), so on a GPU they
are not GPU memory, while a CPU run's tracker counts each (4 bytes, 512 rounded). The tracker
rounds every storage to 512 bytes only on CUDA (``mem_tracker._WeakRefInfo``); the script applies
the same rule to its CPU storages. cuBLAS/cuBLASLt workspaces, which no tracker sees, are created
by the warm-up before the baseline, as in PyTorch's test.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.fsdp")

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "distributed_programs"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
for _var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
    ENV.pop(_var, None)

ADAM_STEPS = 12 * 512   # 3 blocks x 4 parameters: one host float32 step counter each, 512 rounded


def _run(cmd: list[str]) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def vram_peaks(script: str, *args: str, nproc: int = 2) -> dict[int, int]:
    """Each rank's printed ``peak N`` under ``vram run --nproc-per-node nproc``."""
    out = _run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(nproc), str(PROGRAMS / script), *args])
    return {int(r): int(v) for r, v in re.findall(r"^\[rank(\d+)\]:peak (\d+)$", out, re.M)}


@pytest.mark.parametrize("args", [(), ("--no-reshard", "--foreach"), ("--bf16",)],
                         ids=["default", "no-reshard-foreach", "bf16"])
def test_fsdp2_peak_matches_fsdp_mem_tracker(args: tuple[str, ...]) -> None:
    tracker = int(re.findall(r"^peak (\d+)$", _run([sys.executable, str(PROGRAMS / "fsdp2_mlp.py"), "--tracker",
                                                       *args]), re.M)[0])
    peaks = vram_peaks("fsdp2_mlp.py", *args)
    assert peaks == {0: tracker - ADAM_STEPS, 1: tracker - ADAM_STEPS}
