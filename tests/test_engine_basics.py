"""The engine every run uses (`vram.run.engine`, PrivateUse1) seen from a script: tensors answer as
CUDA tensors, storages live and die with PyTorch's references, out-of-memory is torch's, cuBLAS's
workspace and autocast, known values, and structured ops allocating once as their CUDA kernels do."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.runtime import simulated_cuda  # noqa: E402


def test_tensors_answer_as_cuda_tensors() -> None:
    with simulated_cuda():
        x = torch.randn(4, 8, device="cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda and not x.is_meta and not x.is_cpu
        assert x.get_device() == 0
        assert torch.zeros(2, device=x.device).is_cuda
        y = x[1:]
        assert y.data_ptr() == x.data_ptr() + 8 * 4 and y.is_cuda
        a, b = torch.ones(3).to("cuda"), torch.ones(3).cuda()
        assert a.is_cuda and b.device == torch.device("cuda", 0) and a.data_ptr() != b.data_ptr()
        assert torch.cuda.memory_allocated() == 512 * 3  # x, and the two moved copies


def test_module_moves_keep_parameters() -> None:
    with simulated_cuda():
        m = torch.nn.Linear(8, 16)
        w = m.weight
        m.cuda()
        assert m.weight is w and w.is_cuda and isinstance(w, torch.nn.Parameter)
        m.to("cuda")
        assert m.weight is w
        assert torch.cuda.memory_allocated() == 512 + 512  # weight (512 B) and bias (64 B -> 512)


def test_storages_are_freed_when_pytorch_frees_them() -> None:
    with simulated_cuda():
        x = torch.empty(1 << 20, device="cuda")
        assert torch.cuda.memory_allocated() == 4 << 20
        v = x.view(-1, 2)
        del x
        assert torch.cuda.memory_allocated() == 4 << 20
        del v
        assert torch.cuda.memory_allocated() == 0
        assert torch.cuda.memory_reserved() == 20 << 20


def test_out_of_memory_is_torch_s() -> None:
    with simulated_cuda(gpu="1GiB"):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(1 << 30, device="cuda")
        assert torch.cuda.memory_allocated() == 0


def test_cublas_workspace_and_autocast() -> None:
    with simulated_cuda(gpu="A100-80GB"):
        a = torch.randn(64, 64, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = a @ a
            assert out.dtype == torch.bfloat16 and out.is_cuda
            assert torch.softmax(out, -1).dtype == torch.float32
        assert torch.cuda.memory_allocated() > 4 << 20  # the cuBLAS workspace


def test_known_values_and_data_dependent_shapes() -> None:
    """What the default engine knows (tests/test_known_values.py), this one knows: values built
    from factories and host data are exact, and nothing is left to a placeholder."""
    from vram.run.runtime import active_sim

    with simulated_cuda():
        x = torch.ones(4, device="cuda")
        assert bool(x.all()) and x.sum().item() == 4.0
        ids = torch.tensor([1, 2, 3]).cuda()
        assert ids.tolist() == [1, 2, 3] and tuple((ids == 2).nonzero().shape) == (1, 1)
        m = torch.arange(6, device="cuda").reshape(2, 3)
        assert m[m > 2].tolist() == [3, 4, 5]
        assert not active_sim().report.sites


def test_structured_ops_allocate_once_as_cuda_does() -> None:
    """``mse_loss`` (structured, ``native/Loss.cpp``): its scalar output, then the unreduced loss,
    freed on return; the default-backend wrapper's input-sized ``empty`` + ``resize_`` is gone."""
    import torch.nn.functional as F

    with simulated_cuda():
        a, b = torch.randn(128, 256, device="cuda"), torch.randn(128, 256, device="cuda")
        torch.cuda.memory._record_memory_history()
        F.mse_loss(a, b)
        events = torch.cuda.memory._snapshot()["device_traces"][0]
    assert [(e["action"], e["size"]) for e in events if e["action"] in ("alloc", "free_requested")] == [
        ("alloc", 4), ("alloc", 131072), ("free_requested", 131072), ("free_requested", 4)]
