"""torch.linalg on the simulated GPU: outputs charged as CUDA returns them, the library's run-time
sized scratch named once per run (`vram.run.kernels.linalg`), never silently left out."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.kernels.linalg import WORKSPACE  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402


def _named() -> int:
    sim = active_sim()
    assert sim is not None
    return sim.uncharged.get(WORKSPACE, 0)


def test_factorizations_charge_their_outputs_and_name_the_library_scratch() -> None:
    """``linalg_qr`` (reduced) returns Q [m, k] and R [k, n]; ``_linalg_eigh`` the eigenvalues [n]
    and eigenvectors [n, n]; a matmul (cuBLAS) names nothing."""
    with simulated_cuda(gpu="A100-80GB"):
        a = torch.empty(512, 256, device="cuda")
        base = torch.cuda.memory_allocated()
        q, r = torch.linalg.qr(a)
        assert torch.cuda.memory_allocated() - base == 512 * 256 * 4 + 256 * 256 * 4
        assert _named() == 1
        s = torch.empty(256, 256, device="cuda")
        before = torch.cuda.memory_allocated()
        w, v = torch.linalg.eigh(s)
        assert torch.cuda.memory_allocated() - before == 1024 + 256 * 256 * 4
        assert _named() == 2
        a.T @ a
        assert _named() == 2
