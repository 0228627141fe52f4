"""The entry points most training scripts use, run unmodified under ``vram run`` to their end
: Hugging Face ``Trainer`` (bf16, gradient accumulation and
checkpointing, a loss log every step, ``adamw_torch`` and ``adamw_torch_fused``), PEFT LoRA under
``Trainer``, a plain ``accelerate`` loop, and ``Trainer`` on a ``datasets.Dataset`` with evaluation
and ``auto_find_batch_size`` (tests/corpus/).

The expectations come from the same model built here on the CPU and from PyTorch's rules, not from
vram: the printed parameter counts; ``memory_allocated()`` once the model is on the GPU, its
unique parameter and buffer storages rounded to 512-byte blocks (spec §4); and after training,
with gradients set to None and no activation alive, exactly

    model + AdamW's exp_avg and exp_avg_sq per trained parameter (+ its 0-d ``step`` on the
    GPU when fused: ``torch/optim/adam.py`` ``_init_group``) + one cuBLAS workspace per thread that
    ran a matmul (forward, and the autograd engine's device thread: ``getChosenWorkspaceSize()``,
    32 MiB on sm90) + 1 MiB of cuBLASLt workspace per thread that ran an ``addmm`` with a 1-D bias
    (GPT-2's Conv1D; recomputed on the backward thread under gradient checkpointing) + what the
    program keeps (Trainer's ``_tr_loss``, a 0-d float on the device, trainer.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from corpus_output import CORPUS, load_program, printed_values  # noqa: E402
from vram.run.cuda.compat import define_torchvision_ops  # noqa: E402
from vram.run.runtime import run_script  # noqa: E402

define_torchvision_ops()  # transformers imports torchvision, whose PyPI wheel is CUDA torch's

CUBLAS_SM90, CUBLASLT = 32 * 1024 * 1024, 1024 * 1024
TR_LOSS = 512
# id -> (program, its arguments, libraries, fused AdamW, threads with a cuBLASLt addmm, bytes it keeps)
CASES = {
    "trainer-adamw_torch": ("hf_trainer.py", ["adamw_torch"], ("transformers", "accelerate"), False, 0, TR_LOSS),
    "trainer-adamw_torch_fused": ("hf_trainer.py", ["adamw_torch_fused"], ("transformers", "accelerate"),
                                  True, 0, TR_LOSS),
    "peft-lora-trainer": ("peft_trainer.py", [], ("transformers", "accelerate", "peft"), True, 2, TR_LOSS),
    "accelerate-loop": ("accelerate_loop.py", [], ("transformers", "accelerate"), True, 0, 0),
    # TrainingArguments' default optim is adamw_torch_fused (transformers 5)
    "datasets-trainer": ("datasets_trainer.py", [], ("transformers", "accelerate", "datasets"), True, 1, TR_LOSS),
}


def r512(n: int) -> int:
    return max(512, -(-n // 512) * 512)


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_entry_point_runs_with_the_gpu_figures(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    program, args, libs, fused, lt_threads, kept = CASES[case]
    for lib in libs:
        pytest.importorskip(lib)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    cpu = load_program(program).build()  # on the CPU, without vram
    if program == "peft_trainer.py":
        cpu.print_trainable_parameters()
    cpu_lines = capsys.readouterr().out.splitlines()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*cpu.parameters(), *cpu.buffers()]}
    model_bytes = sum(r512(n) for n in storages.values())
    trained = [p for p in cpu.parameters() if p.requires_grad]
    state = sum(2 * r512(p.untyped_storage().nbytes()) + (512 if fused else 0) for p in trained)
    expected_params = sum(p.numel() for p in cpu.parameters())
    del cpu

    assert run_script(str(CORPUS / program), [*args, str(tmp_path / "out")], gpu="24GiB") == 0
    out = capsys.readouterr().out
    printed = printed_values(out)
    assert "done" in printed, out
    assert int(printed["params"]) == expected_params
    assert int(printed["after_move"]) == model_bytes
    assert int(printed["allocated"]) == model_bytes + state + 2 * CUBLAS_SM90 + lt_threads * CUBLASLT + kept
    if program == "hf_trainer.py":  # what TrainingArguments and torch.cuda say on one bf16-capable GPU
        assert printed["device"] == "cuda:0 1 True" and printed["steps"] == "3"
    if program == "accelerate_loop.py":
        assert printed["device"] == "cuda DistributedType.NO 1 True"
        assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == ["1", "3"]
    if program == "peft_trainer.py":  # PEFT's own line, as the CPU model prints it
        assert cpu_lines[-1].startswith("trainable params: 22,528 ||") and cpu_lines[-1] in out.splitlines()
    if program == "datasets_trainer.py":
        assert printed["eval_keys"].split()[:2] == ["epoch", "eval_loss"]
