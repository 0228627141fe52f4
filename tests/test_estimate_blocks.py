"""`vram estimate`'s categories are allocator blocks, as ``memory_allocated()`` counts them, so the
gradients of torchvision's resnet18 under bf16 autocast show 46.14 MiB against 44.64 MiB of
parameters: three gradients land in cached blocks the allocator hands out whole because
splitting would leave at most 1 MiB (``should_split``, large pool; spec §4). The tensors themselves
are the parameters' size: PyTorch's ``MemTracker`` on the CPU counts 44.592 MiB of gradients, equal
to the parameters (``torch.distributed._tools.mem_tracker``, same model, same step). The report says
so instead of leaving "gradients > parameters" unexplained."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.estimate.engine import estimate  # noqa: E402
from vram.estimate.report import _block_notes  # noqa: E402
from vram.run.cuda.compat import define_torchvision_ops  # noqa: E402

MIB = 1 << 20


def test_resnet18_gradients_are_the_parameters_bytes_in_larger_blocks() -> None:
    define_torchvision_ops()
    tv = pytest.importorskip("torchvision")
    r = estimate(tv.models.resnet18, torch.empty(8, 3, 64, 64), amp="bf16", gpu="A100-80GB")
    tensor_bytes = sum(p.numel() * 4 for p in tv.models.resnet18().parameters())  # = MemTracker's GRAD
    assert r.categories_requested["gradients"] == tensor_bytes == r.categories_requested["parameters"]
    assert r.categories["gradients"] > r.categories["parameters"] >= tensor_bytes
    assert "gradients can exceed the parameters they match" in str(r)


def test_the_note_names_categories_whose_blocks_exceed_their_tensors() -> None:
    blocks = {"parameters": 46810112, "buffers": 51200, "gradients": 48382976, "temporaries": 10 * MIB}
    asked = {"parameters": 46758048, "buffers": 38568, "gradients": 46758048, "temporaries": 1 * MIB}
    notes = _block_notes(blocks, asked)
    assert notes[0] == "  gradients: 46.14 MiB of allocator blocks hold 44.59 MiB of tensors"
    assert len(notes) == 3  # parameters (0.1%) and buffers (12 KiB) are rounding; temporaries are not tensors
    assert _block_notes(blocks, {}) == []
