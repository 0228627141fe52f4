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


# -- half precision: SpectralOps.cpp's composites as CUDA runs them (vram.run.kernels.cufft_half) ---


def test_half_precision_transforms_run_as_on_cuda() -> None:
    """``promote_type_fft`` accepts Half on CUDA. On x [4, 64] float16: ``rfft`` is one
    ``_fft_r2c`` (the [4, 33] complex32 output: 528 B; contiguous, aligned: no copy); ``irfft`` of
    that is ``_fft_c2r`` with ``last_dim_size`` 2 * (33 - 1) = 64: the [4, 64] half output (512 B),
    then the input's contiguous clone (528 B) freed on return; ``fft`` of the real input is a
    two-sided ``_fft_r2c`` ([4, 64] complex32: 1,024 B); ``fftn`` promotes the real input to
    complex32 first (``t.to(kComplexHalf)``: 1,024 B), then ``_fft_c2c`` over both dims (1,024 B),
    the promoted copy dying when the composite returns. cuFFT's workspaces are named, one per call."""
    with simulated_cuda(gpu="H200"):
        x = torch.empty(4, 64, dtype=torch.float16, device="cuda")
        keep: list[torch.Tensor] = []
        spec = torch.fft.rfft(x)
        assert spec.dtype == torch.complex32 and spec.shape == (4, 33)
        ev = _trace(lambda: keep.append(torch.fft.irfft(spec)))
        assert ev == [("alloc", 512), ("alloc", 528), ("free_completed", 528)]
        assert keep[0].dtype == torch.float16 and keep[0].shape == (4, 64)
        ev2 = _trace(lambda: keep.append(torch.fft.fft(x)))  # the trace goes on from the first call
        assert ev2[len(ev):] == [("alloc", 1024)]
        ev3 = _trace(lambda: keep.append(torch.fft.fftn(x)))
        assert ev3[len(ev2):] == [("alloc", 1024), ("alloc", 1024), ("free_completed", 1024)]
        assert keep[-1].dtype == torch.complex32
        # fftn with s = (4, 128): the promoted copy (1,024 B), then ``resize_fft_input`` pads it
        # (``constant_pad_nd``: [4, 128] complex32, 2,048 B), the c2c output (2,048 B); the padded
        # input dies when ``fftn_c2c`` returns, the promoted one when ``fft_fftn`` does
        ev4 = _trace(lambda: keep.append(torch.fft.fftn(x, s=(4, 128))))
        assert ev4[len(ev3):] == [("alloc", 1024), ("alloc", 2048), ("alloc", 2048), ("free_completed", 2048),
                                  ("free_completed", 1024)]
        assert _workspace_notes() == 5


def test_half_precision_refusals_are_cudas() -> None:
    """``CuFFTConfig``: half-precision signals must have power-of-two sizes (60 is not), checked
    when the plan is made; a GPU below sm 5.3 has no half cuFFT. bfloat16 is refused by
    ``promote_type_fft`` on CUDA too. Nothing stays allocated after a refusal."""
    with simulated_cuda(gpu="H200"):
        x = torch.empty(4, 60, dtype=torch.float16, device="cuda")
        before = torch.cuda.memory_allocated()
        with pytest.raises(RuntimeError, match=r"powers of two when computing in half precision, but got a signal "
                                               r"size of\[60\]"):
            torch.fft.rfft(x)
        with pytest.raises(RuntimeError, match=r"signal size of\[100\]"):
            torch.fft.irfft(torch.empty(4, 33, dtype=torch.complex32, device="cuda"), n=100)
        assert torch.cuda.memory_allocated() == before
        with pytest.raises(RuntimeError, match="Unsupported dtype BFloat16"):
            torch.fft.fft(x.to(torch.bfloat16))
    with simulated_cuda(gpu="24GiB", arch="5.2"):
        with pytest.raises(RuntimeError, match="less than SM_53, but the device containing input half tensor only "
                                               "has SM_52"):
            torch.fft.rfft(torch.empty(64, dtype=torch.float16, device="cuda"))


def test_half_precision_hermitian_transforms() -> None:
    """``ihfftn`` of x [4, 8, 16] float16 over all dims (``fft_ihfftn_impl``): ``_fft_r2c`` of the
    last dim ([4, 8, 9] complex32: 1,152 B); ``tmp = at::conj_physical(tmp)`` (1,152 B; the
    transform's output freed as it is replaced); ``_fft_c2c`` of dims (0, 1) into a new 1,152 B
    output, whose ``_exec_fft`` clones the input (half precision with an inner stride of 9, not 1:
    ``CuFFTConfig``'s ``clone_input``), 1,152 B freed on return; then ``tmp`` dies. ``_exec_fft``
    leaves that output strided batch-last, (8, 1, 32). ``hfftn`` of it (``fft_hfftn_impl``):
    ``_fft_c2c`` of dims (0, 1) (1,152 B; its input's inner stride is 1 now: no clone), conjugated
    (``conj()``, a view whose conjugate bit the dispatcher's conjugate fallback resolves into a
    1,152 B copy before ``_fft_c2r``, which takes no conjugate views), ``_fft_c2r`` of the last dim
    to 16 points: the [4, 8, 16] half output (1,024 B), then its contiguous clone of the input
    (1,152 B) freed; then the resolved copy, then the c2c result."""
    with simulated_cuda(gpu="H200"):
        x = torch.empty(4, 8, 16, dtype=torch.float16, device="cuda")
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(torch.fft.ihfftn(x)))
        k = 1152
        assert ev == [("alloc", k), ("alloc", k), ("free_completed", k), ("alloc", k), ("alloc", k),
                      ("free_completed", k), ("free_completed", k)]
        ev2 = _trace(lambda: keep.append(torch.fft.hfftn(keep[0])))
        assert keep[0].stride() == (8, 1, 32)
        assert ev2[len(ev):] == [("alloc", k), ("alloc", k), ("alloc", 1024), ("alloc", k), ("free_completed", k),
                                 ("free_completed", k), ("free_completed", k)]
        assert keep[1].shape == (4, 8, 16) and keep[1].dtype == torch.float16
