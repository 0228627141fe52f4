"""What the ``torch.compile`` mode tests share: a small MLP trained under a compile mode, and
``vram run --gpu H200 --snapshot`` of a script, in a subprocess with this checkout's sources."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from paths import REPO


def mlp_script(mode: str, steps: int, report: str = "") -> str:
    """Linear 1024 -> 4096, GELU, Linear 4096 -> 1024, batch 256, compiled with `mode`; `steps`
    forward/backward steps, `report` (a Python expression list) printed after each."""
    line = f"    print('step', i, {report})\n" if report else ""
    return ("import torch\n"
            "m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),\n"
            "                        torch.nn.Linear(4096, 1024)).cuda()\n"
            f"step = torch.compile(m, mode={mode!r})\n"
            "x = torch.randn(256, 1024, device='cuda')\n"
            f"for i in range({steps}):\n"
            "    step(x).sum().backward()\n"
            "    for p in m.parameters():\n"
            "        p.grad = None\n" + line)


def vram_run(script: Path, snapshot: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``vram run --gpu H200 --snapshot SNAPSHOT SCRIPT ARGS``; it must succeed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), *sys.path]))
    done = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "H200", "--snapshot", str(snapshot),
                           str(script), *args], capture_output=True, text=True, env=env, timeout=1800, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done
