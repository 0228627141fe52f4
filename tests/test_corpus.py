"""Small but real programs on the libraries people train with, run under ``vram run`` to their end
: Hugging Face GPT-2 and Llama with GQA (padded masks, gradient checkpointing, bf16
autocast, loss logging, generate), a PEFT LoRA step, a diffusers UNet step, a nanoGPT-style
loop, a torchvision ResNet and a timm ViT trained with AMP and GradScaler (tests/corpus/; PyPI's
torchvision wheel is built for CUDA torch, so its operator library cannot load next to the CPU
torch: `vram.run.cuda.compat` defines its operators' schemas so that it imports, here and under
``vram run``). Each program prints its parameter count and ``torch.cuda.memory_allocated()``
right after moving the model; the expectations come from building the same model here, on the
CPU without vram: the same count, and the model's unique parameter and buffer storages, each
rounded up to the allocator's 512-byte blocks (spec §4).
"""
from __future__ import annotations

import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from corpus_output import CORPUS, load_program, printed_values  # noqa: E402
from vram.run.cuda.compat import define_torchvision_ops  # noqa: E402
from vram.run.runtime import run_script  # noqa: E402

define_torchvision_ops()  # PyPI's torchvision is built for CUDA torch: without this, no import here

PROGRAMS = {  # program -> the libraries it needs
    "hf_gpt2.py": ("transformers",),
    "hf_llama_gqa.py": ("transformers",),
    "peft_lora.py": ("transformers", "peft"),
    "diffusers_unet.py": ("diffusers",),
    "nanogpt_style.py": (),
    "tv_resnet.py": ("torchvision",),
    "timm_vit.py": ("timm", "torchvision"),
}


def _unique_storage_bytes(model: Any) -> int:
    sizes: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        st = t.untyped_storage()
        sizes[st.data_ptr()] = st.nbytes()
    return sum(max(512, -(-n // 512) * 512) for n in sizes.values() if n)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_program_runs_to_its_end_with_the_gpu_figures(program: str, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for lib in PROGRAMS[program]:
        pytest.importorskip(lib)
    monkeypatch.setattr(sys, "path", list(sys.path))
    cpu_model = load_program(program).build()  # on the CPU, no simulation
    expected_params = sum(p.numel() for p in cpu_model.parameters())
    expected_bytes = _unique_storage_bytes(cpu_model)
    del cpu_model
    assert run_script(str(CORPUS / program), [], gpu="24GiB") == 0
    out = capsys.readouterr().out
    printed = printed_values(out)
    assert "done" in printed, out
    assert int(printed["params"]) == expected_params
    assert int(printed["after_move"]) == expected_bytes
    if "state" in printed:  # optimizer state for every trained parameter (ties counted once)
        counts = printed["state"].split()
        assert int(counts[0]) > 0 and (len(counts) == 1 or counts[0] == counts[1])
