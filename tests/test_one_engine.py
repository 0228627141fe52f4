"""One simulation engine: every mode of ``vram run`` and ``vram estimate`` runs on the PrivateUse1
engine (`vram.run.engine`), and the meta engine (`vram.run.engine.meta`, a debugging aid) is
reached only when it is asked for by name (``--backend meta``).

Proved in child processes where that module cannot be imported: a ``sitecustomize`` first on
``PYTHONPATH`` (``site`` imports the first one it finds) puts a finder at the front of
``sys.meta_path`` in every Python process of the run, the launcher's ranks included (they inherit
the environment). The finder logs each attempt to import the meta engine, with the process's
``RANK``, and raises ImportError, so a path that caught the error would still be seen.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch._C, "_acc"):
    pytest.skip("needs torch's experimental Python PrivateUse1 backend (torch._C._acc)", allow_module_level=True)

from test_subclass_formulas import FAMILIES  # noqa: E402
from vram.run.engine import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.load(1), reason=f"needs the engine's C++ device guard: {native.why_not()}")

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "distributed_programs"
META = "vram.run.engine.meta"
HOOK = f'''
import os
import sys


class NoMetaEngine:
    def find_spec(self, name, path=None, target=None):
        if name == {META!r}:
            with open(os.environ["NO_META_ENGINE_LOG"], "a") as f:
                f.write("rank " + os.environ.get("RANK", "-") + "\\n")
            raise ImportError("the meta engine is not importable here")
        return None


sys.meta_path.insert(0, NoMetaEngine())
'''


def _vram(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """``python -m vram ARGS`` in `PROGRAMS` with the meta engine unimportable in every process;
    the attempts to import it (one line per process: its ``RANK``)."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    log = tmp_path / "meta_imports.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VRAM_RUN_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK", "PYTORCH_CUDA_ALLOC_CONF")}
    env.update(PYTHONPATH=os.pathsep.join([str(hook), str(ROOT / "src")]), PYTHONWARNINGS="ignore",
               NO_META_ENGINE_LOG=str(log))
    r = subprocess.run([sys.executable, "-m", "vram", *args], capture_output=True, text=True, env=env,
                       timeout=600, cwd=str(PROGRAMS))
    return r, log.read_text().splitlines() if log.exists() else []


def test_the_hook_bites_in_a_rank_asking_for_the_meta_engine(tmp_path: Path) -> None:
    """The control: a rank asking for ``--backend meta`` tries the import and fails."""
    r, attempts = _vram(tmp_path, "run", "--backend", "meta", "--gpu", "24GiB", "--nproc-per-node", "2",
                        "--ranks", "1", "ddp_formulas.py")
    assert r.returncode != 0
    assert "rank 1" in attempts, (attempts, r.stderr[-2000:])


def test_a_ddp_run_on_two_ranks_never_reaches_the_meta_engine(tmp_path: Path) -> None:
    """Both ranks of a DDP step run, and their backward takes the GPU's in-place formulas
    (tests/test_subclass_formulas.py's families: 6 + 1 + 1 + 1 gradient-sized blocks)."""
    r, attempts = _vram(tmp_path, "run", "--gpu", "24GiB", "--nproc-per-node", "2", "ddp_formulas.py")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert attempts == []
    in_place = sum(family[3] for family in FAMILIES.values())
    for rank in (0, 1):
        assert f"[rank{rank}]:full {in_place}" in r.stdout.splitlines(), r.stdout


def test_an_fsdp_estimate_never_reaches_the_meta_engine(tmp_path: Path) -> None:
    """``vram estimate --fsdp 2``: the layout's rank process estimates without the meta engine.
    Each rank's parameters are half of tiny_stack's 4 blocks (``fully_shard``'s dim-0 shards)."""
    r, attempts = _vram(tmp_path, "estimate", "tiny_stack:stack", "--input", "8x256", "--fsdp", "2", "--json")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert attempts == []
    rank0 = json.loads(r.stdout)["estimates"]["0"]
    assert rank0["fits"] and rank0["categories"]["parameters"] == 4 * 525568 * 4 // 2
