"""Hugging Face model families with their own code paths under ``vram run --gpu A100-80GB``
: tests/corpus/hf_families.py trains each
family's tiny random-initialised model with AdamW in float32 and bf16 autocast and generates.

Expectations from PyTorch and transformers on the CPU, without vram: the printed parameter count
is the CPU model's; ``memory_allocated()`` right after ``model.to("cuda")`` is the model's unique
parameter and buffer storages, each rounded up to the allocator's 512-byte blocks (spec §4). The
mixture-of-experts families run ``torch._grouped_mm`` (transformers' default experts), whose
float32 form torch 2.13's meta kernel refuses and CUDA runs (``GroupedBlas.cpp``): see
tests/test_grouped_mm.py.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vram.run.cuda.compat import define_torchvision_ops  # noqa: E402
from vram.run.runtime import run_script  # noqa: E402

define_torchvision_ops()  # transformers imports torchvision, whose PyPI wheel is CUDA torch's

PROGRAM = Path(__file__).resolve().parent / "corpus" / "hf_families.py"


def _program() -> Any:
    spec = importlib.util.spec_from_file_location("corpus_hf_families", PROGRAM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAMILIES = sorted(_program().FAMILIES)
GENERATES = {"lm", "seq2seq", "audio"}


def _default_eos(family: str) -> Any:
    model_cls, config_cls = _program().FAMILIES[family][:2]
    import transformers

    return getattr(transformers, config_cls)().eos_token_id


def r512(n: int) -> int:
    return max(512, -(-n // 512) * 512)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_and_generates_with_the_cpu_models_figures(family: str, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))
    program = _program()
    cpu = program.build(family)  # on the CPU, without vram
    params = sum(p.numel() for p in cpu.parameters())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*cpu.parameters(),
                                                                                         *cpu.buffers()]}
    del cpu
    assert run_script(str(PROGRAM), [family], gpu="A100-80GB") == 0
    captured = capsys.readouterr()
    lines = dict(line.partition(" ")[::2] for line in captured.out.splitlines())
    assert "done" in lines, captured.out + captured.err
    assert int(lines["params"]) == params
    assert int(lines["after_move"]) == sum(r512(n) for n in storages.values())
    # AdamW steps the moved parameters (its state is on the GPU too)
    assert int(lines["peak"]) >= 4 * int(lines["after_move"])  # parameters, gradients, exp_avg, exp_avg_sq
    task = program.FAMILIES[family][3]
    assert ("generated" in lines) == (task in GENERATES)
    if task == "lm":  # greedy picks token 0 from placeholder logits: 4 new tokens, or 1 where 0 is EOS (Mamba)
        new = 1 if program.FAMILIES[family][2].get("eos_token_id", _default_eos(family)) == 0 else 4
        assert lines["generated"] == f"(2, {16 + new})" and "answered with placeholders" in captured.err
