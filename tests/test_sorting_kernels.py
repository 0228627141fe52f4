"""`vram.run.kernels.sorting`: what sort, topk, cumsum, multinomial, nonzero and scatter_reduce
allocate on CUDA beyond their outputs.

Every expected sequence is worked by hand from PyTorch's CUDA host code (``aten/src/ATen``):

* ``native/Sorting.cpp`` ``sort_stable_out``: the structured outputs (values, indices) exist first.
* ``native/cuda/Sort.cpp`` ``sort_cuda_kernel``: ``size(dim) <= 4096`` (``Sort.h``
  ``should_use_small_sort``): ``fillSliceWithIndex`` = ``at::arange(size(dim))`` int64, freed on
  return; larger: ``self_`` copy unless dense with ``stride(dim) == 1`` (dim-last dense strides,
  ``SortImpl.cu`` ``infer_dense_strides_dim_last``), ``values_tmp``/``indices_tmp`` when the
  outputs' strides differ from ``self_``'s.
* ``native/cuda/SortStable.cu`` ``launch_stable_sort_kernel``: one segment: ``DeviceArray
  indices(nsort)`` (int64); 2..127 segments: two ``int2`` (8-byte) buffers of numel and
  ``radix_sort_pairs(keys_out=nullptr)``'s ``keys_out_owner`` of numel keys (``cub-RadixSortPairs.cuh``),
  freed after that call; 128+ segments: ``reverse_indices`` (numel int64). cub's temporary storage
  is named, never charged.
* ``native/ReduceOps.cpp`` ``impl_func_cum_ops`` + ``ScanUtils.cuh`` ``scan_dim``: ``self.to(out
  dtype)`` (strides kept), ``expect_contiguous()``, cub only when ``numel == size(dim)``.
* ``native/Distributions.cpp`` ``multinomial_out`` (one sample): result, ``aminmax`` (two 0-dim),
  ``>= 0``, ``< INFINITY``, ``&`` (0-dim bools), ``sum(1)`` [B], ``== 0`` [B] bool, ``any`` (0-dim),
  ``~``, ``q = empty_like(self)``, ``argmax_out`` into the result.
* ``native/cuda/Nonzero.cu`` ``nonzero_cuda_out_impl``: ``num_nonzeros`` (int), cub sum (named), the
  output, cub select (named).
* ``native/TensorAdvancedIndexing.cpp`` ``scatter_reduce_two`` (mean): ``ones_like(src)``,
  ``zeros_like(out)``, ``count == 0`` (bool), freed mask first, then count, then ones.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.kernels.plan import op_plan  # noqa: E402
from vram.run.kernels.sorting import cub_note, dense_strides_dim_last  # noqa: E402
from vram.run.kernels.unique import THRUST_NOTE, unique_outputs  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

H200 = 132
VOCAB = 50257


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def _sort(x: torch.Tensor, **kwargs):
    v, i = torch.sort(x, **kwargs)
    return op_plan("sort", (x,), [v, i], H200, 2048, (9, 0), {"stable": False, **kwargs})


def _charged(plan) -> list[tuple[str, int]]:
    return [(s, a) for s, a in plan if s != "note"]


def test_small_sort_fills_an_index_range_only() -> None:
    # [8, 100] fp32, dim -1: 100 <= 4096: arange(100) int64 = 800 B, freed when fillSliceWithIndex returns
    assert _sort(_meta(8, 100)) == [("out", 0), ("out", 1), ("tmp", 800), ("free", 0)]


def test_one_row_of_logits_sorts_as_one_large_segment() -> None:
    # [1, 50257] fp32, descending: dense, stride(-1) == 1: no copies; nsegments = 1:
    # DeviceArray<int64> indices(50257) = 402,056 B around the cub radix sort (named)
    plan = _sort(_meta(1, VOCAB), descending=True)
    assert plan == [("out", 0), ("out", 1), ("tmp", 402056), ("note", cub_note("sort")), ("free", 0)]


def test_a_batch_of_logits_sorts_fully_then_by_segment() -> None:
    # [2, 50257] fp32: nsegments = 2 < 128: indices_and_segment, indices_and_segment2 (int2:
    # 2 * 50257 * 8 = 804,112 B each), keys_out_owner (100,514 fp32 keys = 402,056 B) freed after
    # radix_sort_pairs, then the key sort; the int2 buffers die in reverse declaration order
    plan = _sort(_meta(2, VOCAB), descending=True)
    assert _charged(plan) == [("out", 0), ("out", 1), ("tmp", 804112), ("tmp", 804112), ("tmp", 402056),
                              ("free", 2), ("free", 1), ("free", 0)]
    assert plan.count(("note", cub_note("sort"))) == 1


def test_many_rows_sort_with_a_segmented_cub_sort() -> None:
    # [128, 5000] bf16: nsegments = 128: reverse_indices = 640,000 int64 = 5,120,000 B
    plan = _sort(_meta(128, 5000, dtype=torch.bfloat16))
    assert _charged(plan) == [("out", 0), ("out", 1), ("tmp", 5120000), ("free", 0)]


def test_sorting_along_a_strided_dim_copies_input_and_both_outputs() -> None:
    # [5000, 3] fp32 sorted along dim 0: stride(0) = 3: self_ copy with strides (1, 5000) = 60,000 B;
    # the outputs keep the input's strides (3, 1) != (1, 5000): values_tmp 60,000 B, indices_tmp
    # 120,000 B; 3 segments: int2 buffers 120,000 B each, keys_out_owner 60,000 B;
    # frees: keys_out_owner, the int2 pair (2nd, 1st), then indices_tmp, values_tmp, self_
    assert dense_strides_dim_last(_meta(5000, 3), 0) == [1, 5000]
    plan = _sort(_meta(5000, 3), dim=0)
    assert _charged(plan) == [("out", 0), ("out", 1), ("tmp", 60000), ("tmp", 60000), ("tmp", 120000),
                              ("tmp", 120000), ("tmp", 120000), ("tmp", 60000),
                              ("free", 5), ("free", 4), ("free", 3), ("free", 2), ("free", 1), ("free", 0)]


def test_cumsum_copies_a_converted_strided_input_and_names_cub_for_one_row() -> None:
    # int32 [4, 8].t() -> int64 output: to(int64) keeps strides (256 B, not contiguous), then
    # expect_contiguous() copies again (256 B); 2-D rows scan with ATen's own kernel
    x = _meta(4, 8, dtype=torch.int32).t()
    out = torch.cumsum(x, 1)
    assert op_plan("cumsum", (x, 1), [out], H200) == [("out", 0), ("tmp", 256), ("tmp", 256), ("free", 1), ("free", 0)]
    # one row of probabilities: numel == size(dim): cub inclusive_scan, nothing charged
    row = _meta(VOCAB)
    assert op_plan("cumsum", (row, 0), [torch.cumsum(row, 0)], H200) == [("out", 0), ("note", cub_note("cumsum"))]


def test_multinomial_one_sample_allocates_exponential_noise_of_the_input() -> None:
    # [2, 50257] fp32, one sample: result [2, 1] int64; aminmax min/max (4 B each; 100,514 inputs
    # reduce in one block on 132 SMs: no staging), ge, lt, & (1 B each; lt then ge die);
    # sum(1) [2] fp32 = 8 B, == 0 [2] bool = 2 B, any() 1 B (eq then sum die); ~ 1 B (dies);
    # q = empty_like(self) = 402,056 B; argmax_out writes the existing result; then q, the any,
    # is_valid, min, max die
    p = _meta(2, VOCAB)
    plan = op_plan("multinomial", (p, 1), [_meta(2, 1, dtype=torch.long)], H200)
    assert plan == [("out", 0), ("tmp", 4), ("tmp", 4), ("tmp", 1), ("tmp", 1), ("tmp", 1), ("free", 3), ("free", 2),
                    ("tmp", 8), ("tmp", 2), ("tmp", 1), ("free", 6), ("free", 5), ("tmp", 1), ("free", 8),
                    ("tmp", 402056), ("free", 9), ("free", 7), ("free", 4), ("free", 0), ("free", 1)]


def test_sorted_topk_of_more_than_4096_sorts_a_copy() -> None:
    # [3, 10000] fp32, k = 5000, sorted: 3 slices of 10,000 < 20,000: single-block select;
    # 5000 > 4096: sortedIndices 3*5000*8 = 120,000, sortedValues 60,000, the sort (3 segments:
    # int2 x2 120,000, keys 60,000), indices.gather(...) 120,000 freed after its copy
    x = _meta(3, 10000)
    v, i = torch.topk(x, 5000)
    plan = _charged(op_plan("topk", (x, 5000), [v, i], H200))
    assert plan == [("out", 0), ("out", 1), ("tmp", 120000), ("tmp", 60000), ("tmp", 120000), ("tmp", 120000),
                    ("tmp", 60000), ("free", 4), ("free", 3), ("free", 2), ("tmp", 120000), ("free", 5),
                    ("free", 1), ("free", 0)]
    # top-50 of two rows of logits: 2 slices <= 20 of 50,257 >= 20,000: the multi-block radix
    # select (mbtopk::launch): items_per_thread = clamp(ceil(100,514 / (132 SMs * 6 * 256)), 4, 64)
    # = 4, blocks_per_slice = ceil(50,257 / 1,024) = 50, 100 blocks: kthValues 2*4, semaphores 2*4,
    # ks_to_find 2*2*4, desired 2*2*4, counts 100*256*2 = 51,200, withinKCounts and kthCounts
    # 100*4; two cub scans by key (named once); freed in reverse
    logits = _meta(2, VOCAB)
    v, i = torch.topk(logits, 50)
    assert op_plan("topk", (logits, 50), [v, i], H200) == [
        ("out", 0), ("out", 1), ("tmp", 8), ("tmp", 8), ("tmp", 16), ("tmp", 16), ("tmp", 51200), ("tmp", 400),
        ("tmp", 400), ("note", cub_note("topk")), *(("free", k) for k in range(6, -1, -1))]


def test_scatter_reduce_mean_counts_and_nonzero_count() -> None:
    # mean of 20x4 fp32 src into 10x4: ones_like(src) 320, zeros_like(out) 160, count == 0 40 (bool)
    x, idx, src = _meta(10, 4), _meta(20, 4, dtype=torch.long), _meta(20, 4)
    plan = op_plan("scatter_reduce", (x, 0, idx, src, "mean"), [_meta(10, 4)], H200, kwargs={"include_self": False})
    assert plan == [("out", 0), ("tmp", 320), ("tmp", 160), ("tmp", 40), ("free", 2), ("free", 1), ("free", 0)]
    # nonzero of a transposed [4, 8] bool: contiguous copy 32 B, num_nonzeros 4 B, the output
    m = _meta(8, 4, dtype=torch.bool).t()
    plan = op_plan("nonzero", (m,), [_meta(10, 2, dtype=torch.long)], H200)
    # (its two cub calls, a reduce and a select, are named once per call of the op)
    assert plan == [("tmp", 32), ("tmp", 4), ("note", cub_note("nonzero")), ("out", 0), ("free", 1), ("free", 0)]


def test_top_p_sampling_step_on_the_simulated_h200() -> None:
    """One top-p step as generation loops write it: the sort's scratch and multinomial's noise raise
    the peak above the outputs; cub's storage is named once per kind of call."""
    with simulated_cuda(gpu="H200"):
        logits = torch.empty(1, VOCAB, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        # values 201,028 -> 201,216 B block; indices 402,056 -> 402,432 B; the DeviceArray 402,432 B
        assert torch.cuda.max_memory_allocated() - base == 201216 + 402432 + 402432
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)  # [1, V]: numel == size(dim): cub scan, named
        del cum
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        torch.multinomial(probs, 1)
        # result 512; min, max, ge, lt, and: 5 x 512; sum(1) [1] 512, eq 512, any 512; q 201,216:
        # at q's allocation: result + min, max, is_valid, any + q (ge, lt, sum, eq, ~ freed)
        assert torch.cuda.max_memory_allocated() - before == 512 * 5 + 201216
        notes = active_sim().uncharged
        assert notes[cub_note("sort")] == 1 and notes[cub_note("cumsum")] == 1


def test_unique_keeps_worst_case_outputs_and_its_sort_buffers() -> None:
    """``UniqueCub.cu`` (``_unique2`` -> ``unique_cuda_template(self, consecutive=false)``), 8,000
    int64 ids, inverse and counts: ``sorted = empty(self.sizes())`` 64,000; ``range = arange(8000)``
    64,000 and ``sorted_indices`` 64,000 around the cub pair sort, range freed at the end of its
    block; ``compute_unique``: ``inverse_indices`` 64,000 (output), ``inv_loc_out`` 64,000 freed
    after the scan; ``data_out = empty({num_inp})`` 64,000 (output), ``length`` 8,
    ``counts.resize_(num_inp)`` 64,000 (output); length, sorted_indices, sorted die. The outputs
    keep their 8,000-element storage after ``resize_(num_out)``, and their values."""
    with simulated_cuda(gpu="H200"):
        ids = torch.tensor([3, 1, 3, 7, 1, 1, 9, 3] * 1000, device="cuda")
        torch.cuda.memory._record_memory_history()
        u, inv, cnt = torch.unique(ids, return_inverse=True, return_counts=True)
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        assert u.untyped_storage().nbytes() == cnt.untyped_storage().nbytes() == 64000
        assert u.tolist() == [1, 3, 7, 9] and cnt.tolist() == [3000, 3000, 1000, 1000]
        assert inv.shape == (8000,)
        assert active_sim().uncharged[cub_note("unique")] == 1  # three cub calls, one call of the op
    got = [(e["action"][0], e["size"]) for e in trace if e["action"] in ("alloc", "free_requested")]
    assert got == [("a", 64000), ("a", 64000), ("a", 64000), ("f", 64000), ("a", 64000), ("a", 64000), ("f", 64000),
                   ("a", 64000), ("a", 8), ("a", 64000), ("f", 8), ("f", 64000), ("f", 64000)]


def test_unique_of_bools_counts_trues_and_keeps_two_element_outputs() -> None:
    # bool, not consecutive: DeviceArray<int>(1) 4 B, cub reduce; output empty({2}) bool (2 B),
    # counts empty({2}) int64 (16 B) even without return_counts; the inverse 3 x 8 = 24 B
    b = _meta(3, dtype=torch.bool)
    outs = [_meta(2, dtype=torch.bool), _meta(3, dtype=torch.long), _meta(0, dtype=torch.long)]
    assert op_plan("_unique2", (b, True, True), outs, H200) == [
        ("tmp", 4), ("note", cub_note("unique")), ("out", 0), ("out", 2), ("out", 1), ("free", 0)]

    values, _, counts = unique_outputs("_unique2", (b, True, True), {}, tuple(outs))
    assert values.untyped_storage().nbytes() == 2 and counts.untyped_storage().nbytes() == 16


def test_unique_along_a_dim_copies_rows_and_sorts_indices() -> None:
    """``unique(dim=0)`` (``unique_dim_cuda_template``, Unique.cu) of 1,000 int64 rows of 2 (3
    distinct), with inverse and counts: ``input_flat`` is ``x.moveaxis(0, 0)``, contiguous, so no
    copy; ``indices = arange(1000)`` 8,000 B; ``compute_unique``: ``inv_loc`` 8,000 B and the
    inverse output 8,000 B, ``inv_loc`` dying with its block; ``range = arange(1001)`` 8,008 B,
    ``counts.resize_(3)`` 24 B (the output), ``range`` dying with its block; ``index_select``'s
    [3, 2] values 48 B; ``indices`` freed. ``unique(y, dim=1)`` of ``y = x.t()`` [2, 1000], nothing
    else asked: ``y.moveaxis(1, 0)`` is x again (no copy), ``indices`` 8,000 B, inverse and counts
    ``empty({0})`` (nothing), the [2, 3] values 48 B, ``indices`` freed. Of a strided [1000, 2]
    (``z.t()`` for z [2, 1000]) along dim 0: ``moveaxis`` keeps it strided, so its 16,000 B copy
    comes first and dies last. Thrust's own storage is named once per call."""
    with simulated_cuda(gpu="H200"):
        x = torch.tensor([[1, 2], [3, 4], [1, 2], [5, 6], [3, 4]] * 200, device="cuda")
        z = torch.empty(2, 1000, dtype=torch.long, device="cuda")
        torch.cuda.memory._record_memory_history()
        u, inv, cnt = torch.unique(x, dim=0, return_inverse=True, return_counts=True)
        v = torch.unique(x.t(), dim=1)
        w = torch.unique_consecutive(z.t(), dim=0)
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        assert u.tolist() == [[1, 2], [3, 4], [5, 6]] and cnt.tolist() == [400, 400, 200] and inv.shape == (1000,)
        assert v.shape == (2, 3) and w.shape[1] == 2
        assert active_sim().uncharged[THRUST_NOTE] == 3
    got = [(e["action"][0], e["size"]) for e in trace if e["action"] in ("alloc", "free_requested")]
    assert got[:12] == [("a", 8000), ("a", 8000), ("a", 8000), ("f", 8000), ("a", 8008), ("a", 24), ("f", 8008),
                        ("a", 48), ("f", 8000), ("a", 8000), ("a", 48), ("f", 8000)]
    assert got[12:] == [("a", 16000), ("a", 8000), ("a", w.numel() * 8), ("f", 8000), ("f", 16000)]
