"""torch.fft on the simulated GPU as ``aten/src/ATen/native/cuda/SpectralOps.cpp`` and
``CuFFTPlanCache.h`` run it: the copies and clones each transform makes, in order; cuFFT's plan
workspace (sized by cuFFT) is named, not charged."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from traced import allocator_events  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402


def _trace(fn) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    return allocator_events(fn)


def _workspace_notes() -> int:
    sim = active_sim()
    assert sim is not None
    return sum(n for what, n in sim.uncharged.items() if what.startswith("cuFFT plan workspaces"))


def test_complex_to_real_clones_its_input() -> None:
    """``_fft_c2r_cufft``: the output, then ``self.clone(MemoryFormat::Contiguous)`` (a C2R may
    overwrite its input, gh-34551), freed when the call returns."""
    with simulated_cuda(gpu="H200"):
        spec = torch.empty(8, 2049, dtype=torch.complex64, device="cuda")
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(torch.fft.irfft(spec)))
        assert ev == [("alloc", 8 * 4096 * 4), ("alloc", 8 * 2049 * 8), ("free_completed", 8 * 2049 * 8)]
        assert _workspace_notes() == 1


def test_real_input_not_aligned_as_complex_is_copied() -> None:
    """``_fft_r2c_cufft``: cuFFT wants real input aligned as a complex one would be; a view at an
    odd float offset is copied (last dim contiguous) after the output is made."""
    with simulated_cuda(gpu="H200"):
        base = torch.empty(5, 9, device="cuda")
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(torch.fft.rfft(base[:, 1:])))
        assert ev == [("alloc", 5 * 5 * 8), ("alloc", 5 * 8 * 4), ("free_completed", 5 * 8 * 4)]
        ev = _trace(lambda: keep.append(torch.fft.rfft(base[1:, 1:])))  # offset 10 floats: aligned
        assert ev[-1] == ("alloc", 4 * 5 * 8)


def test_a_middle_dim_transform_copies_the_batch_dims_together() -> None:
    """``_exec_fft`` permutes the batch dims first and reshapes them to one: over dim 1 of a
    contiguous [4, 6, 10] tensor the batch dims (strides 60 and 1) do not collapse to a view."""
    with simulated_cuda(gpu="H200"):
        x = torch.empty(4, 6, 10, dtype=torch.complex64, device="cuda")
        keep: list[torch.Tensor] = []
        nbytes = 4 * 6 * 10 * 8
        ev = _trace(lambda: keep.append(torch.fft.fft(x, dim=1)))
        assert ev == [("alloc", nbytes), ("alloc", nbytes), ("free_completed", nbytes)]
        ev = _trace(lambda: keep.append(torch.fft.fft(x, dim=2)))   # the last dim: a view
        assert ev[-1] == ("alloc", nbytes) and len(ev) == 4


def test_a_transform_over_dims_0_and_1_takes_two_buffers() -> None:
    """``use_optimized_cufft_path`` is false for dims starting with (0, 1): the R2C of the last dim
    writes a first buffer, the output is made, the C2C of dim 0 writes it, the first buffer dies."""
    with simulated_cuda(gpu="H200"):
        x = torch.empty(8, 64, device="cuda")
        keep: list[torch.Tensor] = []
        half = 8 * 33 * 8
        ev = _trace(lambda: keep.append(torch.fft.rfft2(x)))
        assert ev == [("alloc", half), ("alloc", half), ("free_completed", half)]
        assert _workspace_notes() == 2


def test_istft_reads_its_window_envelope_as_the_gpu_does() -> None:
    """``istft`` (SpectralOps.cpp) checks ``window_envelop.abs().min() >= 1e-11`` on the device: the
    envelope is the window's squares overlap-added over every frame (``col2im`` of a
    [n_fft, n_frames] expansion), known from the window alone, so the check passes as on a GPU
    (a placeholder envelope of zeros failed it) and nothing is assumed."""
    with simulated_cuda(gpu="H200", strict_values=True):
        wav = torch.randn(16, 64000, device="cuda")
        window = torch.hann_window(400, device="cuda")
        spec = torch.stft(wav, 400, 160, window=window, return_complex=True)
        assert tuple(spec.shape) == (16, 201, 401)
        rec = torch.istft(spec, 400, 160, window=window, length=64000)
        assert tuple(rec.shape) == (16, 64000)
        with pytest.raises(RuntimeError, match="window overlap add min"):
            torch.istft(spec, 400, 160, window=torch.zeros(400, device="cuda"), length=64000)
