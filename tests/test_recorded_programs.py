"""The programs behind the shared recordings, run under ``vram run`` with the recorded settings and
compared with what their GPU recorded: the allocation-size sequence, the new segments
and both peaks. The programs are other people's code: they are read from ../shared/programs (see
its README for the commands) and copied to a temporary folder to run; the tests skip without it.
On failure, `vram diff` prints the first divergence with both stacks.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from paths import PROGRAMS  # noqa: E402
from paths import RECORDINGS as TRACES  # noqa: E402
from vram.replay.diff import compare, render, side  # noqa: E402
from vram.replay.loader import load_snapshot  # noqa: E402
from vram.run.runtime import run_script  # noqa: E402


def _reproduce(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str, script: list[str], env: dict[str, str],
               gpu: str, output: str, recording: str, modules: tuple[str, ...]) -> object:
    if not (PROGRAMS / folder).is_dir():
        pytest.skip("needs ../shared/programs beside the checkout")
    for module in modules:
        pytest.importorskip(module)
    work = tmp_path / folder
    shutil.copytree(PROGRAMS / folder, work)
    for path in work.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    monkeypatch.chdir(work)
    # PYTHONPATH=$PWD: after sys.path[0], which run_script (and fast_init.py) set to a script's folder
    monkeypatch.setattr(sys, "path", [*sys.path[:1], str(work), *sys.path[1:]])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for name in [m for m in sys.modules if m.split(".")[0] in ("cs336_basics", "cs336_systems")]:
        monkeypatch.delitem(sys.modules, name)
    assert run_script(script[0], script[1:], gpu=gpu) == 0
    result = compare(side("GPU", load_snapshot(TRACES / recording)), side("vram", load_snapshot(work / output)))
    return result


def test_s_bf16_forward_reproduces_its_recording(tmp_path, monkeypatch) -> None:
    """CS336 "small" LM (12 layers, d 768), ctx 128, batch 4, bf16 autocast forward under no_grad."""
    r = _reproduce(tmp_path, monkeypatch, "s_bf16", ["benchmark.py"], {"PREC": "bf16"}, "A100-80GB",
                   "memory_forward_bf16_128.pickle", "cs336-s-forward-bf16-128.pickle",
                   ("einops", "jaxtyping", "pandas"))
    assert r.identical, render(r)  # type: ignore[attr-defined]
    assert (r.a.peak_allocated, r.a.peak_reserved) == (r.b.peak_allocated, r.b.peak_reserved)  # type: ignore[attr-defined]


def test_s_mem_forward_backward_reproduces_its_recording(tmp_path, monkeypatch) -> None:
    """Attention forward + output.sum().backward(), Q/K/V 8 x 4096 x 16 fp32, from an empty allocator."""
    r = _reproduce(tmp_path, monkeypatch, "s_mem", ["trace_peak_memory.py"], {}, "A100-80GB",
                   "mem_snapshot.pickle", "cs336-s-mem.pickle", ("einops", "pandas"))
    assert (r.a.peak_allocated, r.a.peak_reserved) == (r.b.peak_allocated, r.b.peak_reserved)  # type: ignore[attr-defined]
    assert r.identical, render(r)  # type: ignore[attr-defined]


@pytest.mark.slow  # a 2.7B model: minutes
def test_k_run_forward_reproduces_its_recording(tmp_path, monkeypatch) -> None:
    """CS336 2.7B LM, ctx 128, batch 4, fp32 forward with grad enabled (H100: 32 MiB cuBLAS workspace)."""
    r = _reproduce(tmp_path, monkeypatch, "k_run", [str(PROGRAMS / "fast_init.py"), "cs336_systems/benchmark.py"],
                   {"FWD": "1", "CTXS": "128"}, "H100", "memory_ctx128_forward.pickle",
                   "cs336-k-forward-ctx128.pickle", ("einops", "jaxtyping", "pandas"))
    assert r.identical, render(r)  # type: ignore[attr-defined]
