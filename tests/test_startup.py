"""What ``vram run`` does before and around a script: nothing the script does not need.

A GPU run of ``torch.ones(..., device="cuda") * 2`` imports neither DTensor (``torch.distributed.tensor``,
which imports sympy) nor ``torch._dynamo``; a simulated run should not either, while a script that
does import DTensor still gets vram's patches of it (`vram.run.cuda.on_import`), and one that
compiles still gets torch's dynamo-disabled dispatch (`vram.run.engine.dynamo_guard`). Speed itself
is measured by benchmarks/bench_startup.py, not here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("VRAM_RUN_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
ENV.update(PYTHONPATH=str(ROOT / "src"), PYTHONWARNINGS="ignore")


def _vram_run(tmp_path: Path, script: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    r = subprocess.run([sys.executable, "-m", "vram", "run", "--gpu", "24GiB", str(path)], capture_output=True,
                       text=True, env=ENV, timeout=600, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_script_that_makes_tensors_imports_neither_dtensor_nor_dynamo(tmp_path: Path) -> None:
    out = _vram_run(tmp_path, """\
        import sys
        import torch
        y = torch.ones(1024, device="cuda") * 2
        w = torch.empty(512, 512)
        torch.nn.init.normal_(w)          # a lazy host tensor: LazyHostMode pushed, normal_'s meta kernel
        print(float(y.sum()), torch.cuda.memory_allocated(),
              [m for m in ("torch.distributed.tensor", "torch._dynamo") if m in sys.modules])
    """)
    assert out.split() == ["2048.0", "4096", "[]"]  # y's 4 KiB (the temporary ones died)


def test_dtensor_imported_by_the_script_is_patched(tmp_path: Path) -> None:
    out = _vram_run(tmp_path, """\
        import torch.distributed.tensor._op_schema as schema
        import torch.distributed.tensor._random as dtensor_random
        print(schema._rebuild_tensor_from_dtensor_meta.__module__,
              dtensor_random.OffsetBasedRNGTracker._get_device_state.__module__)
    """)
    assert out.split() == ["vram.run.distributed.dtensor"] * 2


def test_dispatch_under_dynamo_is_torchs_disabled_function(tmp_path: Path) -> None:
    """Once ``torch._dynamo`` is imported, a dispatch mode's ``__torch_dispatch__`` is what
    ``torch._disable_dynamo`` makes of it (dynamo's ``DisableContext`` wrapper)."""
    out = _vram_run(tmp_path, """\
        import torch
        import torch._dynamo
        from vram.run.engine.meta import DispatchMode
        w = torch.empty(512, 512)
        torch.nn.init.normal_(w)
        raw = DispatchMode.__torch_dispatch__.__wrapped__
        from vram.run.engine.lazy import LazyHostMode
        lazy = LazyHostMode.__torch_dispatch__.__wrapped__
        print(getattr(lazy, "__dynamo_disable").__module__, float(w.std()) > 0.9)
    """)
    assert out.split() == ["torch._dynamo.eval_frame", "True"]


def test_when_imported_patches_a_module_once_it_is_executed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vram.run.cuda.on_import import _FINDER, when_imported

    (tmp_path / "late_module.py").write_text("VALUE = 1\ndef read():\n    return VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[int] = []

    def patch(module: object) -> None:
        seen.append(module.read())  # type: ignore[attr-defined]  # executed before the patch
        module.VALUE = 2  # type: ignore[attr-defined]

    cancel = when_imported("late_module", patch)
    never = when_imported("late_module_never", lambda m: None)
    assert _FINDER in sys.meta_path and not seen
    import late_module  # type: ignore[import-not-found]
    assert seen == [1] and late_module.read() == 2
    assert late_module.__loader__.get_source("late_module").startswith("VALUE = 1")  # the loader's own
    cancel()
    never()
    assert _FINDER not in sys.meta_path and not _FINDER.waiting
    when_imported("late_module", patch)  # already imported: at once
    assert seen == [1, 2]
    sys.modules.pop("late_module", None)
