"""CTC loss, cummax, bincount and histc on the simulated GPU as CUDA runs them
(`vram.run.kernels.ctc`, `scans`, `histograms`). Every expected size is derived by hand from
``native/cuda/LossCTC.cu`` (``ctc_loss_gpu_template``, ``ctc_loss_backward_gpu_template``),
``native/ReduceOps.cpp`` (``logsumexp_out_impl``), ``native/cudnn/LossCTC.cpp``
(``_use_cudnn_ctc_loss``), ``native/cuda/ScanKernels.cpp`` and ``native/cuda/SummaryOps.cu``, in
bytes; ``a`` an allocation, ``f`` a free."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from traced import allocator_events  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402


def _ctc_inputs(t: int, b: int, c: int, s: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.randn(t, b, c, device="cuda").log_softmax(2).detach().requires_grad_()
    return (lp, torch.randint(1, c, (b, s), device="cuda"), torch.full((b,), t, dtype=torch.long),
            torch.full((b,), s, dtype=torch.long))


def test_ctc_forward_allocates_its_index_tensors_then_log_alpha_then_the_loss() -> None:
    """T 50, batch 4, 20 labels, targets [4, 30]: ``target_lengths_t``, ``input_lengths_t`` and the
    batch offsets on the GPU (4 int64: 32 B each), ``log_alpha`` [4, 50, 61] float (48,800 B), then
    ``neg_log_likelihood`` [4] (16 B); the three index tensors freed when the template returns, the
    input lengths first (declared last). ``reduction="none"``: nothing else."""
    with simulated_cuda(gpu="H200"):
        lp, tg, il, tl = _ctc_inputs(50, 4, 20, 30)
        kept: list[torch.Tensor] = []
        got = allocator_events(lambda: kept.append(F.ctc_loss(lp, tg, il, tl, reduction="none")), short=True)
    assert got == [("a", 32), ("a", 32), ("a", 32), ("a", 4 * 50 * 61 * 4), ("a", 16), ("f", 32), ("f", 32),
                   ("f", 32)]


def test_a_small_ctc_backward_adds_log_beta() -> None:
    """``2 T + 24 batch / 10 + 2 labels / 10`` = 100 + 9 + 4 = 113 <= 450: one kernel. The three index
    tensors (32 B), ``log_beta = empty_like(log_alpha)`` (48,800 B), the gradient (``full_like(log_probs)``,
    [50, 4, 20] float: 16,000 B), then ``log_beta`` and the index tensors freed."""
    with simulated_cuda(gpu="H200"):
        lp, tg, il, tl = _ctc_inputs(50, 4, 20, 30)
        loss = F.ctc_loss(lp, tg, il, tl, reduction="sum")
        got = allocator_events(loss.backward, short=True)
        sim = active_sim()
        assert sim is not None and not sim.report.sites
    start = got.index(("a", 32))
    assert got[start:start + 9] == [("a", 32), ("a", 32), ("a", 32), ("a", 48_800), ("a", 16_000), ("f", 48_800),
                                    ("f", 32), ("f", 32), ("f", 32)]


def test_a_large_ctc_backward_with_zero_infinity_computes_the_blanks_with_logsumexp() -> None:
    """T 300, batch 8, 40 labels, targets of 60: 600 + 19 + 8 = 627 > 450 (``is_large``). The index
    tensors (64 B each), ``log_beta`` [8, 300, 121] (1,161,600 B), the gradient [300, 8, 40]
    (384,000 B); ``log_alpha + log_beta`` on every other column, [8, 300, 61] (585,600 B); its
    ``logsumexp(.., 2, true)``: ``amax`` [8, 300, 1] (9,600 B; 61 values a row: one block, no
    staging), ``abs`` (9,600 B) and ``== INFINITY`` (2,400 B) freed mask first, ``self - maxes``
    (585,600 B), ``sum`` into the result (9,600 B), the difference and the maxima freed; at the end
    of the statement the result, then the sum of alpha and beta. ``zero_infinity``: ``at::where``'s
    ``zeros({})`` (4 B) and ``nll.view(1, 8, 1) == INFINITY`` (8 B), its output (384,000 B) replacing
    the gradient (freed), then the mask and the zero; ``log_beta`` and the index tensors."""
    ab, beta, grad, row = 8 * 300 * 61 * 4, 8 * 300 * 121 * 4, 300 * 8 * 40 * 4, 8 * 300 * 4
    with simulated_cuda(gpu="H200"):
        lp, tg, il, tl = _ctc_inputs(300, 8, 40, 60)
        loss = F.ctc_loss(lp, tg, il, tl, reduction="sum", zero_infinity=True)
        got = allocator_events(loss.backward, short=True)
    start = got.index(("a", 64))
    assert got[start:start + 27] == [
        ("a", 64), ("a", 64), ("a", 64), ("a", beta), ("a", grad), ("a", ab), ("a", row), ("a", row), ("a", 2400),
        ("f", 2400), ("f", row), ("a", ab), ("a", row), ("f", ab), ("f", row), ("f", row), ("f", ab),
        ("a", 4), ("a", 8), ("a", grad), ("f", grad), ("f", 8), ("f", 4), ("f", beta), ("f", 64), ("f", 64),
        ("f", 64)]


def test_a_ctc_loss_that_takes_cudnn_is_refused_in_one_line() -> None:
    """Blank 0, concatenated int32 targets on the host, float32 log_probs, every input of full length
    and targets under 256: ``_use_cudnn_ctc_loss`` is true on a GPU (cuDNN's workspace: unknown);
    with cuDNN off the native kernel runs."""
    with simulated_cuda(gpu="H200"):
        lp = torch.randn(50, 4, 20, device="cuda").log_softmax(2)
        tg = torch.randint(1, 20, (4 * 10,), dtype=torch.int32)
        with pytest.raises(NotImplementedError, match="^vram run: torch.ctc_loss through cuDNN is not modelled"):
            F.ctc_loss(lp, tg, [50] * 4, [10] * 4)
        with torch.backends.cudnn.flags(enabled=False):
            assert F.ctc_loss(lp, tg, [50] * 4, [10] * 4).shape == ()
        assert F.ctc_loss(lp, tg, [49] * 4, [10] * 4).shape == ()  # not every input of full length


def test_cummax_of_a_transposed_tensor_copies_it_and_reads_no_value() -> None:
    """``x.t().cummax(1)`` on x [100, 50] float: ``cummax`` allocates values (20,000 B) and indices
    (40,000 B) contiguous; ``_cummax_helper`` (no meta kernel) scans a contiguous copy of the
    transposed input (20,000 B), freed when the scan returns. No value is read."""
    with simulated_cuda(gpu="H200"):
        x = torch.randn(100, 50, device="cuda")
        got = allocator_events(lambda: x.t().cummax(1), short=True)
        sim = active_sim()
        assert sim is not None and not sim.report.sites
    assert got[:4] == [("a", 20_000), ("a", 40_000), ("a", 20_000), ("f", 20_000)]


def test_ctc_lengths_whose_values_are_unknown_are_a_data_dependent_read() -> None:
    """CUDA's CTC loss reads its lengths to the host (``ctc_loss.Tensor``: ``.to(kCPU)``; the longest
    target sizes ``log_alpha``): lengths summed from a mask of 400,000 ones (beyond the values a run
    keeps) stop the call as a data-dependent read (a ``vram run`` then runs again with real values);
    the same lengths from a small known mask run."""
    from vram.run.values.placeholders import DataDependentError

    with simulated_cuda(gpu="H200"):
        lp = torch.randn(50, 4, 20, device="cuda").log_softmax(2)
        tg = torch.randint(1, 20, (4, 30), device="cuda")
        frames = torch.ones(4, 100_000, device="cuda").sum(-1).long() // 2000  # 50 each, not kept
        with pytest.raises(DataDependentError, match="input lengths"):
            F.ctc_loss(lp, tg, frames, torch.full((4,), 30, device="cuda"))
        known_frames = torch.ones(4, 50, device="cuda").sum(-1).long()
        assert F.ctc_loss(lp, tg, known_frames, torch.full((4,), 30, device="cuda")).shape == ()


def test_bincount_reads_its_minimum_and_maximum_before_its_output() -> None:
    """``_bincount_cuda_template`` (SummaryOps.cu) on 5000 int64 ids under 100: ``self.min()`` then
    ``self.max()`` read to the host, each a 0-dim int64 (8 B; 5000 values take one block: no
    staging) freed with its statement, then ``zeros({nbins})`` (100 int64: 800 B). bfloat16 weights
    are first made double (``weights.to(kDouble)``: 40,000 B), freed when the call returns, the
    output then double (800 B). Nothing is named."""
    with simulated_cuda(gpu="H200"):
        ids = torch.arange(5000, device="cuda") % 100
        w = torch.rand(5000, device="cuda", dtype=torch.bfloat16)
        kept: list[torch.Tensor] = []
        plain = allocator_events(lambda: kept.append(torch.bincount(ids)), short=True)
        weighted = allocator_events(lambda: kept.append(torch.bincount(ids, weights=w)), short=True)
        sim = active_sim()
        assert sim is not None and not sim.uncharged
    extrema = [("a", 8), ("f", 8), ("a", 8), ("f", 8)]
    assert plain == [*extrema, ("a", 800)]
    assert weighted[len(plain):] == [("a", 40_000), *extrema, ("a", 800), ("f", 40_000)]
    assert kept[1].dtype == torch.float64


def test_histc_reads_the_range_from_the_data_only_when_not_given() -> None:
    """``_histc_cuda_template``: ``zeros({bins})`` (50 float: 200 B) first; with ``min == max`` (the
    default 0, 0) ``self.min()`` and ``self.max()`` (0-dim float, 4 B each) read to the host."""
    with simulated_cuda(gpu="H200"):
        x = torch.randn(5000, device="cuda")
        kept: list[torch.Tensor] = []
        from_data = allocator_events(lambda: kept.append(torch.histc(x, bins=50)), short=True)
        given = allocator_events(lambda: kept.append(torch.histc(x, bins=50, min=-3, max=3)), short=True)
    assert from_data == [("a", 200), ("a", 4), ("f", 4), ("a", 4), ("f", 4)]
    assert given[len(from_data):] == [("a", 200)]
