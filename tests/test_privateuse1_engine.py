"""``vram run --backend privateuse1`` (experimental; `vram.run.engine`): its cases
(tests/privateuse1_engine_cases.py) run in a child pytest, because the engine registers
PrivateUse1 for the whole process (a registered accelerator can change what torch picks
elsewhere) and must not share a worker with the default engine's tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.skipif(not hasattr(torch._C, "_acc"),
                    reason="needs torch's experimental Python PrivateUse1 backend (torch._C._acc)")
def test_the_privateuse1_engine_cases_pass() -> None:
    cases = Path(__file__).with_name("privateuse1_engine_cases.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-p", "no:xdist", "-o", "addopts=",
                          "-p", "no:cacheprovider", str(cases)], capture_output=True, text=True, env=env,
                         timeout=1200, cwd=cases.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
