"""``x[idx]``'s backward on the simulated GPU as CUDA runs it: autograd's ``index_backward``
(FunctionsManual.cpp: ``_index_put_impl_(zeros_like(self), indices, grad, true, /*unsafe=*/true)``)
reaches ``index_put_with_sort_kernel`` (native/cuda/Indexing.cu); every expected size below is
derived from that source (`vram.run.kernels.indexing`), in bytes, ``a`` an allocation, ``f`` a free."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from traced import allocator_events  # noqa: E402
from vram.run.kernels.sorting import UNMODELLED, cub_note  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

N, ROWS, F = 5000, 1000, 64
IDX = 8 * N    # one int64 per index


def _backward_events(loss: torch.Tensor) -> list[tuple[str, int]]:
    return allocator_events(loss.backward, short=True)


def test_gather_backward_sorts_linear_indices_and_copies_an_expanded_gradient() -> None:
    """``x[idx].sum().backward()``: the initial gradient (4 B), ``zeros_like(x)`` (256,000 B);
    ``computeLinearIndex``: ``idx.remainder(1000)`` (40,000 B), times the stride 64 (40,000 B), the
    remainder dying with the expression; the gradient, ``sum``'s expanded 0-dim one, made contiguous
    as ``vals_shape`` [5000, 64] (1,280,000 B); ``sorted_indices``, ``orig_indices``, ``range``
    (40,000 B each) freed last made first, then the contiguous gradient and the linear index; the
    zeros become ``x.grad``. cub's sort storage is named."""
    with simulated_cuda(gpu="H200"):
        x = torch.randn(ROWS, F, device="cuda", requires_grad=True)
        idx = torch.randint(0, ROWS, (N,), device="cuda")
        got = _backward_events(x[idx].sum())
        sim = active_sim()
        assert sim is not None and sim.uncharged.get(cub_note("index_put_(accumulate=True)")) == 1
        assert UNMODELLED["_index_put_impl_"] not in sim.uncharged
    assert got == [("a", 4), ("a", ROWS * F * 4), ("a", IDX), ("a", IDX), ("f", IDX), ("a", N * F * 4),
                   ("a", IDX), ("a", IDX), ("a", IDX), ("f", IDX), ("f", IDX), ("f", IDX), ("f", N * F * 4),
                   ("f", IDX), ("f", 4)]


def test_a_contiguous_gradient_is_used_in_place() -> None:
    """``(x[idx] * w).sum()``: the gradient reaching ``index_backward`` is ``grad * w``, contiguous
    [5000, 64]: no copy between the linear index and the sort's buffers."""
    with simulated_cuda(gpu="H200"):
        x = torch.randn(ROWS, F, device="cuda", requires_grad=True)
        w = torch.randn(N, F, device="cuda")
        idx = torch.randint(0, ROWS, (N,), device="cuda")
        got = _backward_events((x[idx] * w).sum())
        put = got.index(("a", ROWS * F * 4))
        assert got[put + 1:put + 11] == [("a", IDX), ("a", IDX), ("f", IDX), ("a", IDX), ("a", IDX), ("a", IDX),
                                         ("f", IDX), ("f", IDX), ("f", IDX), ("f", IDX)]


#: a user's put checks its indices' range first (``wrapIndexOnce`` with ``check_range``):
#: ``aminmax`` of the 5000 int64 indices (its 0-dim min and max, 8 B each; 5000 values take one
#: block of Reduce.cuh's reduction, so no staging buffer), ``_assert_async(max < 1000)`` and
#: ``_assert_async(min >= -1000)`` on 1-byte comparisons that die with their statements, the
#: extrema dying at the end of the check (min first: the tuple's first element)
CHECK = [("a", 8), ("a", 8), ("a", 1), ("f", 1), ("a", 1), ("f", 1), ("f", 8), ("f", 8)]
#: then the remainder and the linear index (the remainder dies with the expression), the value
#: already [5000, 64] and contiguous (no copy), the sort's three buffers freed in reverse
SORT = [("a", IDX), ("a", IDX), ("f", IDX), ("a", IDX), ("a", IDX), ("a", IDX), ("f", IDX), ("f", IDX),
        ("f", IDX)]


def _put_events(put: object) -> list[tuple[str, int]]:
    return allocator_events(put, short=True)  # type: ignore[arg-type]


def test_a_users_put_checks_the_range_of_its_indices() -> None:
    """``y.index_put_((idx,), w, accumulate=True)`` (``unsafe=false``): `CHECK`, then `SORT`, the
    linear index freed last; no uncharged note but cub's."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(ROWS, F, device="cuda")
        w = torch.randn(N, F, device="cuda")
        idx = torch.randint(0, ROWS, (N,), device="cuda")
        got = _put_events(lambda: y.index_put_((idx,), w, accumulate=True))
        sim = active_sim()
        assert sim is not None and UNMODELLED["_index_put_impl_"] not in sim.uncharged
    assert got == [*CHECK, *SORT, ("f", IDX)]


def test_int32_indices_are_made_int64_first() -> None:
    """int32 indices: ``makeLinearIndex`` makes each one int64 (``i.to(kLong)``, 40,000 B) before
    the linear index, and frees it when it returns (after the linear index, before the sort)."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(ROWS, F, device="cuda")
        w = torch.randn(N, F, device="cuda")
        idx = torch.randint(0, ROWS, (N,), device="cuda", dtype=torch.int32)
        got = _put_events(lambda: y.index_put_((idx,), w, accumulate=True))
    assert got == [("a", IDX), *CHECK, ("a", IDX), ("a", IDX), ("f", IDX), ("f", IDX), *SORT[3:], ("f", IDX)]


def test_a_non_contiguous_self_is_copied_and_freed_last() -> None:
    """``y.t()`` ([1000, 64] with strides (1, 1000)): ``self.contiguous()`` (256,000 B) first, copied
    back and freed when the kernel returns, after the linear index."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(F, ROWS, device="cuda")
        w = torch.randn(N, F, device="cuda")
        idx = torch.randint(0, ROWS, (N,), device="cuda")
        got = _put_events(lambda: y.t().index_put_((idx,), w, accumulate=True))
    assert got == [("a", ROWS * F * 4), *CHECK, *SORT, ("f", IDX), ("f", ROWS * F * 4)]


def test_a_boolean_mask_is_expanded_by_nonzero() -> None:
    """``x[m].sum().backward()``, ``m`` a [1000, 64] mask with 16,000 entries (every fourth): the
    initial gradient (4 B), ``zeros_like(x)`` (256,000 B); ``expandTensors``: ``m.nonzero()``
    (Nonzero.cu: ``num_nonzeros``, 4 B, then the [16000, 2] int64 output, 256,000 B, then the
    count freed); per column (unsafe: no check) the remainder and the product (128,000 B each),
    the second product added into the first and freed; the nonzero output freed when
    ``makeLinearIndex`` returns; the gradient, ``sum``'s expanded one, made contiguous as
    ``vals_shape`` [16000] (64,000 B); the sort's three buffers (128,000 B each)."""
    nnz, nz = 16000, 8 * 16000
    with simulated_cuda(gpu="H200"):
        x = torch.randn(ROWS, F, device="cuda", requires_grad=True)
        m = torch.arange(ROWS * F, device="cuda").view(ROWS, F) % 4 == 0
        got = _backward_events(x[m].sum())
        sim = active_sim()
        assert sim is not None and UNMODELLED["_index_put_impl_"] not in sim.uncharged
    assert got == [("a", 4), ("a", ROWS * F * 4), ("a", 4), ("a", 2 * nz), ("f", 4),
                   ("a", nz), ("a", nz), ("f", nz), ("a", nz), ("a", nz), ("f", nz), ("f", nz), ("f", 2 * nz),
                   ("a", nnz * 4), ("a", nz), ("a", nz), ("a", nz), ("f", nz), ("f", nz), ("f", nz),
                   ("f", nnz * 4), ("f", nz), ("f", 4)]


def test_indices_on_non_adjacent_dims_sort_a_transposed_copy() -> None:
    """``z[a, :, b]`` on z [8, 100, 16, 32] (a, b: 50 int64 each): ``transposeToFront`` makes ``src``
    z's [8, 16, 100, 32] permutation; the two linear-index terms (400 B each, the second added in
    and freed); the gradient of ``sum`` made contiguous as [50, 100, 32] (640,000 B); then, the
    permuted ``src`` not contiguous, ``src.contiguous()`` (1,638,400 B) before the sort's buffers,
    freed after them (it is declared first in the block)."""
    with simulated_cuda(gpu="H200"):
        z = torch.randn(8, 100, 16, 32, device="cuda", requires_grad=True)
        a = torch.randint(0, 8, (50,), device="cuda")
        b = torch.randint(0, 16, (50,), device="cuda")
        got = _backward_events(z[a, :, b].sum())
    zb, i = 8 * 100 * 16 * 32 * 4, 400
    assert got == [("a", 4), ("a", zb), ("a", i), ("a", i), ("f", i), ("a", i), ("a", i), ("f", i), ("f", i),
                   ("a", 640_000), ("a", zb), ("a", i), ("a", i), ("a", i), ("f", i), ("f", i), ("f", i),
                   ("f", zb), ("f", 640_000), ("f", i), ("f", 4)]


def test_a_known_mask_whose_count_the_value_does_not_give_is_counted_from_its_values() -> None:
    """``y.index_put_((m,), scalar, accumulate=True)`` (``Tensor.index_put_``: ``unsafe=false``), m
    every other row of 1,000: the 0-dim value does not carry the 500 entries, the mask's known
    values do. ``m.nonzero()``: its 4 B count, the [500, 1] int64 output (4,000 B), the count
    freed; the range check: ``aminmax`` (two 0-dim int64, 8 B each; 500 elements reduce in one
    block), ``index_max < size`` and ``index_min >= -size`` (1 B each, each freed with its
    statement), the extrema freed; ``remainder`` (4,000 B) and ``linearIndex`` (4,000 B), the
    remainder freed; ``makeLinearIndex`` returns: the nonzero freed; the value expanded to
    ``vals_shape`` [500, 64] made contiguous (128,000 B); ``sorted_indices``, ``orig_indices``,
    ``range`` (4,000 B each) freed last made first; then the expanded value and the linear index."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(ROWS, F, device="cuda")
        m = torch.arange(ROWS, device="cuda") % 2 == 0
        one = torch.tensor(1.0, device="cuda")
        got = allocator_events(lambda: y.index_put_((m,), one, accumulate=True), short=True)
        sim = active_sim()
        assert sim is not None and UNMODELLED["_index_put_impl_"] not in sim.uncharged
    k = 4000
    assert got == [("a", 4), ("a", k), ("f", 4), ("a", 8), ("a", 8), ("a", 1), ("f", 1), ("a", 1), ("f", 1),
                   ("f", 8), ("f", 8), ("a", k), ("a", k), ("f", k), ("f", k), ("a", 128_000), ("a", k), ("a", k),
                   ("a", k), ("f", k), ("f", k), ("f", k), ("f", 128_000), ("f", k)]


def test_a_mask_whose_values_are_unknown_and_not_counted_by_the_value_stays_named() -> None:
    """The same put through a mask of uninitialized memory (``torch.empty``: values unknown) and a
    0-dim value: nothing gives the number of entries, so the op names what it does not charge."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(ROWS, F, device="cuda")
        m = torch.empty(ROWS, device="cuda", dtype=torch.bool)
        y.index_put_((m,), torch.tensor(1.0, device="cuda"), accumulate=True)
        y[m] = torch.tensor(2.0, device="cuda")
        sim = active_sim()
        assert sim is not None and sim.uncharged.get(UNMODELLED["_index_put_impl_"]) == 1
        assert sim.uncharged.get(UNMODELLED["index_put_"]) == 1


# -- x[idx] and x[idx] = v: make_info (TensorAdvancedIndexingUtils.h) -------------------------------


KEPT: list[object] = []  # the results of `_events`, kept so that they are not freed between calls


def _events(fn: object) -> list[tuple[str, int]]:
    return allocator_events(lambda: KEPT.append(fn()), short=True)  # type: ignore[operator]


def test_a_mask_index_makes_its_nonzero_before_the_output_and_frees_it_after() -> None:
    """``y[m]``, y [1000, 64] float, m every other row: ``index.Tensor``'s meta function runs
    ``make_info``: ``m.nonzero()`` (``num_nonzeros`` 4 B, the [500, 1] int64 output 4,000 B, the
    count freed), then ``build_index_op`` allocates the output [500, 64] (128,000 B); the nonzero
    is the iterator's operand, freed when the op ends. A mask on the host: its nonzero is the
    host's, copied over whole (4,000 B)."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(ROWS, F, device="cuda")
        m = torch.arange(ROWS, device="cuda") % 2 == 0
        on_gpu = _events(lambda: y[m])
        mc = m.cpu()
        on_host = _events(lambda: y[mc])
    assert on_gpu == [("a", 4), ("a", 4000), ("f", 4), ("a", 128_000), ("f", 4000)]
    assert on_host[len(on_gpu):] == [("a", 4000), ("a", 128_000), ("f", 4000)]


def test_int32_and_broadcast_indices_are_copied_for_the_kernel() -> None:
    """``y[i32]`` (5000 int32): ``make_info`` makes it int64 (40,000 B) before the output
    (5000 x 64 float: 1,280,000 B), freed after. ``y[b[:, None], k]`` (b 100 int64, k [100, 8]):
    broadcast, b's strides (1, 0) differ from k's (8, 1), so ``AdvancedIndex`` makes the
    non-contiguous one contiguous (100 x 8 int64: 6,400 B); output [100, 8] float (3,200 B)."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(ROWS, F, device="cuda")
        i32 = torch.randint(0, ROWS, (N,), device="cuda", dtype=torch.int32)
        b = torch.arange(100, device="cuda")
        k = torch.randint(0, F, (100, 8), device="cuda")
        ints = _events(lambda: y[i32])
        pairs = _events(lambda: y[b[:, None], k])
    assert ints == [("a", IDX), ("a", N * F * 4), ("f", IDX)]
    assert pairs[len(ints):] == [("a", 6400), ("a", 3200), ("f", 6400)]


def test_setitem_of_a_number_allocates_no_gpu_scalar() -> None:
    """``y[:, 0] = 0.0`` and ``y[m] = 1.0``: ``THPVariable_setitem`` makes the number a host tensor
    for a CUDA tensor, so a slice is filled and a mask takes ``masked_fill_``: nothing allocated.
    ``y[i32] = 2.0`` (odd rows): ``_index_put_impl_`` copies the host scalar over (4 B), ``make_info``
    makes the index int64 (40,000 B); both die when it returns, the index first. ``y[m2] = t`` with t
    [16000] (m2: every fourth of [1000, 64]): the mask's nonzero ([16000, 2] int64: 256,000 B,
    after its 4-byte count)."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(ROWS, F, device="cuda")
        m = torch.arange(ROWS, device="cuda") % 2 == 0
        m2 = torch.arange(ROWS * F, device="cuda").view(ROWS, F) % 4 == 0
        i32 = (torch.arange(N, device="cuda") % 500 * 2 + 1).int()  # odd rows
        t = torch.ones(16000, device="cuda")

        def puts() -> None:
            y[:, 0] = 0.0
            y[m] = 1.0
            y[i32] = 2.0
            y[m2] = t

        got = allocator_events(puts, short=True)
        assert y[0, :2].tolist() == [1.0, 1.0] and y[1, :2].tolist() == [1.0, 2.0]
    assert got == [("a", 4), ("a", IDX), ("f", IDX), ("f", 4), ("a", 4), ("a", 256_000), ("f", 4), ("f", 256_000)]


def test_setitem_of_a_number_under_a_cuda_default_device() -> None:
    """``torch.set_default_device("cuda")`` (Meta's llama generation): the host scalar of
    ``probs[mask] = 0.0`` is still made on the host (nothing allocated on the GPU)."""
    with simulated_cuda(gpu="H200"):
        torch.set_default_device("cuda")
        try:
            probs = torch.rand(4, 100)
            mask = probs > 0.5
            got = allocator_events(lambda: probs.__setitem__(mask, 0.0), short=True)
        finally:
            torch.set_default_device(None)
    assert got == []


def test_a_known_mask_beside_other_indices_and_a_broadcast_value_are_counted() -> None:
    """``y[m, i]`` (y [10, 4], m every other row: 5 entries, i 5 int64): ``make_info`` makes
    ``m.nonzero()`` (4 B count, [5, 1] int64 = 40 B, the count freed); the mask's column and i
    have the same strides (no copies); the output [5] float (20 B); the nonzero freed when the op
    ends. ``z[m2] = v`` (z [1000, 64], m2 every fourth row: 250 entries, v [64] broadcast over
    them): ``_index_put_impl_``'s ``make_info``: the nonzero (4 B count, [250, 1] int64 = 2,000 B,
    the count freed), the put through it, the nonzero freed; v is broadcast by the iterator."""
    with simulated_cuda(gpu="H200"):
        y = torch.zeros(10, 4, device="cuda")
        m = torch.arange(10, device="cuda") % 2 == 0
        i = torch.tensor([0, 1, 2, 3, 0], device="cuda")
        z = torch.zeros(ROWS, F, device="cuda")
        m2 = torch.arange(ROWS, device="cuda") % 4 == 0
        v = torch.ones(F, device="cuda")
        pair = _events(lambda: y[m, i])
        put = allocator_events(lambda: z.__setitem__(m2, v), short=True)
        assert z[4].sum().item() == F and z[1].sum().item() == 0
        sim = active_sim()
        assert sim is not None and UNMODELLED["index"] not in sim.uncharged
        assert UNMODELLED["index_put_"] not in sim.uncharged
    assert pair == [("a", 4), ("a", 40), ("f", 4), ("a", 20), ("f", 40)]
    assert put[len(pair):] == [("a", 4), ("a", 2000), ("f", 4), ("f", 2000)]
