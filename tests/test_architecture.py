"""The architecture as checks that can fail (docs/architecture.md): the layer contract
(import-linter), lint (ruff), the type check of the core (mypy) and the size of files.

Each tool reads its configuration from pyproject.toml. The contract tests also plant an upward
import and an import cycle in a copy of the package and require the contract to break.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "vram"
#: Modules allowed over `MAX_MODULE_LINES`, with the reason.
LONG_FILES: dict[str, str] = {
    "allocator/caching.py": "CachingAllocator's malloc/free/stream-event core: one class that mypyc compiles as a "
                            "unit (vram.allocator.native); release, expandable segments and private pools are "
                            "already its mixins",
    "frontend/memory.py": "torch.cuda.memory's names over simulated GPUs, as torch/cuda/memory.py holds them in one "
                          "module: `vram.memory.<name>` is the public path of each (README, run.cuda.api)",
}
#: Functions allowed over `MAX_FUNCTION_LINES`, with the reason.
LONG_FUNCTIONS: dict[str, str] = {}
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _lint_imports(pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_contracts_kept() -> None:
    """Imports go only down the layers, no package has an import cycle, the core imports no torch."""
    r = _lint_imports()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 kept, 0 broken" in r.stdout, r.stdout


@pytest.mark.parametrize("planted, broken", [
    # the allocator reaching up into the torch.cuda-shaped front end
    (("allocator/block.py", "from vram.frontend import memory as _upward  # noqa: F401\n"),
     "Imports only go down the layers"),
    # expandable segments importing the allocator that imports them (the old cycle)
    (("allocator/expandable.py", "from . import caching as _cycle  # noqa: F401\n"), "No import cycles"),
    # the charged storages reaching up into the kernels' allocation plans
    (("run/memory/storage_api.py", "from vram.run.kernels import plan as _upward  # noqa: F401\n"),
     "The simulated-CUDA runtime's floors go down"),
    # the allocator core importing torch
    (("allocator/stats.py", "import torch as _heavy  # noqa: F401\n"), "The core imports no torch"),
])
def test_import_contracts_catch_violations(tmp_path: Path, planted: tuple[str, str], broken: str) -> None:
    copy = tmp_path / "vram"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    path, line = planted
    target = copy / path
    target.write_text(target.read_text() + line)
    r = _lint_imports(pythonpath=tmp_path)
    assert r.returncode != 0, r.stdout
    assert broken in r.stdout and "broken." in r.stdout, r.stdout
    assert any(ln.startswith(broken) and ln.rstrip().endswith("BROKEN") for ln in r.stdout.splitlines()), r.stdout


def test_ruff_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks", "examples"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_core_type_checks() -> None:
    from mypy import api

    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", os.devnull])
    assert status == 0, out + err


def test_files_stay_focused() -> None:
    """No module over `MAX_MODULE_LINES` lines without a reason recorded in LONG_FILES."""
    too_long = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES and rel not in LONG_FILES:
            too_long[rel] = n
    assert not too_long, f"split these or record why in LONG_FILES: {too_long}"


def test_functions_stay_short() -> None:
    """No function over `MAX_FUNCTION_LINES` lines (its whole body, docstring included) without a
    reason recorded in LONG_FUNCTIONS."""
    import ast

    too_long = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                n = node.end_lineno - node.lineno + 1
                key = f"{rel}::{node.name}"
                if n > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                    too_long[key] = n
    assert not too_long, f"split these or record why in LONG_FUNCTIONS: {too_long}"
