"""`vram.run.kernels.scratch` and `vram.run.kernels.embedding_bag`: what embedding, embedding-bag,
layer-norm and RMS-norm backward kernels allocate besides outputs.

Expected sequences are worked by hand from the CUDA host code (``aten/src/ATen/native/cuda``):
``Embedding.cu`` ``embedding_dense_backward_cuda``, ``EmbeddingBag.cu``, ``EmbeddingBackwardKernel.cu``
``embedding_backward_cuda_kernel`` and ``layer_norm_kernel.cu`` ``layer_norm_backward_cuda`` /
``LaunchGammaBetaBackwardCUDAKernel``; each step is derived in the comments.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from vram.run.kernels.embedding_bag import UNMODELLED as EMBEDDING_BAG_UNMODELLED  # noqa: E402
from vram.run.kernels.plan import op_plan  # noqa: E402
from vram.run.kernels.reductions import reduction_plan  # noqa: E402
from vram.run.kernels.scratch import CUB_NOTE, embedding_backward_plan, norm_backward_plan  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

A100 = 108


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def test_few_indices_allocate_only_grad_weight() -> None:
    # num_indices <= 3072 && !scale_grad_by_freq: embedding_backward_feature_kernel into
    # grad_weight = at::zeros({num_weights, D}); no sort
    idx = _meta(3072, dtype=torch.long)
    assert embedding_backward_plan((_meta(3072, 64), idx, 1000, -1, False), [_meta(1000, 64)], A100) == [("out", 0)]


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_sorted_embedding_backward_on_both_engines(backend) -> None:
    # 8 x 512 = 4,096 int64 indices (> 3072), 1,000 x 64 fp32 weight, A100 (108 SMs):
    # embedding_dense_backward_cuda: sorted_indices, orig_indices, range = arange(4096): 3 x 32,768;
    #   cub radix_sort_pairs' temp storage (not charged), range freed at the end of its lambda;
    # embedding_backward_cuda_kernel: grad_weight zeros 1000*64*4 = 256,000; segment_offsets[4096]
    #   32,768; num_of_segments 0-dim int64 8; max_segments = min(4096, 1000) = 1000:
    #   partials_per_segment 8,000, partials_per_segment_offset 8,000, num_of_partial_segments 8;
    #   max_partial_segment = 4096/10 + 1000 = 1,409: partial_segment_offset 11,272;
    #   stride_warped 64, block 64, sum_scatter_grid = 1000*64/64 = 1000 >= 108*4 = 432: not fused,
    #   grad_weight_per_segment [1409, 64] fp32 = 360,704, freed at the end of its block;
    #   then the lambda's locals in reverse, the kernel's, and the caller's (orig, sorted).
    with simulated_cuda(gpu="A100-80GB", backend=backend):
        emb = torch.nn.Embedding(1000, 64, device="cuda")
        loss = emb(torch.zeros(8, 512, dtype=torch.long, device="cuda")).sum()
        torch.cuda.memory._record_memory_history()
        loss.backward()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
    got = [(e["action"][0], e["size"]) for e in trace if e["action"] in ("alloc", "free_requested")]
    kernel = [("a", 32768), ("a", 32768), ("a", 32768), ("f", 32768), ("a", 256000), ("a", 32768), ("a", 8),
              ("a", 8000), ("a", 8000), ("a", 8), ("a", 11272), ("a", 360704), ("f", 360704), ("f", 11272),
              ("f", 8), ("f", 8000), ("f", 8000), ("f", 8), ("f", 32768), ("f", 32768), ("f", 32768)]
    # before: sum's 0-dim grad (4 B) and its expand materialised by .contiguous() (4096*64*4); after:
    # that copy, the indices (saved for backward, released with the graph) and the 0-dim grad
    assert got == [("a", 4), ("a", 1048576), *kernel, ("f", 1048576), ("f", 32768), ("f", 4)]


def test_few_segments_take_the_fused_atomic_path() -> None:
    # 4,096 indices into 10 rows, fp16 D 64: max_segments 10, max_partial_segment 409 + 10 = 419,
    # sum_scatter_grid 10 < 432 and 419 > 40: fused. partial_segment_offset and then
    # partial_to_segment_idx, [419] int64 = 3,352 each;
    # half: grad_weight_acc = zeros({10, 64}, float) = 2,560 (freed after copy_), then the mapping
    idx, grad = _meta(4096, dtype=torch.long), _meta(4096, 64, dtype=torch.float16)
    plan = embedding_backward_plan((grad, idx, 10, -1, False), [_meta(10, 64, dtype=torch.float16)], A100)
    assert plan == [("tmp", 32768), ("tmp", 32768), ("tmp", 32768), ("note", CUB_NOTE), ("free", 2), ("out", 0),
                    ("tmp", 32768), ("tmp", 8), ("tmp", 80), ("tmp", 80), ("tmp", 8), ("tmp", 3352), ("tmp", 3352),
                    ("tmp", 2560), ("free", 10), ("free", 9), ("free", 8), ("free", 7), ("free", 6), ("free", 5),
                    ("free", 4), ("free", 3), ("free", 1), ("free", 0)]
    # deterministic algorithms turn the atomic path off: grad_weight_per_segment [419, 64] fp32 instead
    # of the mapping (partial_segment_offset stays)
    torch.use_deterministic_algorithms(True)
    try:
        det = embedding_backward_plan((grad, idx, 10, -1, False), [_meta(10, 64, dtype=torch.float16)], A100)
    finally:
        torch.use_deterministic_algorithms(False)
    assert det is not None and ("tmp", 419 * 64 * 4) in det and det.count(("tmp", 3352)) == 1


def test_scale_grad_by_freq_sorts_and_counts_even_few_indices() -> None:
    # scale_grad_by_freq always sorts; count = empty_like(indices) after the sort, freed with the
    # caller's locals (count, orig, sorted). int32 indices: 4-byte index tensors. 100 indices,
    # 50 rows, D 8: max_segments 50, max_partial 10 + 50 = 60; grid 50*32/32 = 50 < 432, 60 > 200
    # is false: two-pass, grad_weight_per_segment [60, 8] fp32 = 1,920
    idx = _meta(100, dtype=torch.int32)
    plan = embedding_backward_plan((_meta(100, 8), idx, 50, -1, True), [_meta(50, 8)], A100)
    assert plan == [("tmp", 400), ("tmp", 400), ("tmp", 400), ("note", CUB_NOTE), ("free", 2), ("tmp", 400),
                    ("out", 0), ("tmp", 400), ("tmp", 8), ("tmp", 200), ("tmp", 200), ("tmp", 8), ("tmp", 240),
                    ("tmp", 1920), ("free", 10), ("free", 9), ("free", 8), ("free", 7), ("free", 6), ("free", 5),
                    ("free", 4), ("free", 3), ("free", 1), ("free", 0)]


def test_a_strided_gradient_is_copied_first() -> None:
    # grad_.contiguous() before anything else; freed when the function returns
    grad = _meta(64, 100).t()
    plan = embedding_backward_plan((grad, _meta(100, dtype=torch.long), 20, -1, False), [_meta(20, 64)], A100)
    assert plan == [("tmp", 100 * 64 * 4), ("out", 0), ("free", 0)]


def test_layer_norm_backward_usual_sizes_allocate_only_outputs() -> None:
    # M = 4096, N = 768: M <= 64*1024, ConfigureAndLaunchGammaBetaBackwardKernel writes dgamma/dbeta
    x, w = _meta(4096, 768), _meta(768)
    args = (x, x, [768], _meta(4096, 1), _meta(4096, 1), w, w, [True, True, True])
    assert op_plan("native_layer_norm_backward", args, [x, w, w], A100) == [("out", 0), ("out", 1), ("out", 2)]


def test_layer_norm_backward_large_m_sums_partial_blocks() -> None:
    # M = 131,072 > 65,536 and N/32 = 24 < 108/2: blocks.x = 24, blocks.y = min(32768/24 = 1365,
    # 131072/32 = 4096) = 1365; dX, then the first dgamma/dbeta (768*4 each: released when
    # *dgamma = dgamma_blocks.sum(0) assigns), dgamma_blocks and dbeta_blocks [1365, 768] fp32 =
    # 4,193,280 each; each sum(0) allocates the returned gradient (with its own staging,
    # reduction_plan) and drops the first; the blocks die at the end of the branch.
    x, w = _meta(128, 1024, 768), _meta(768)
    args = (x, x, [768], _meta(128, 1024, 1), _meta(128, 1024, 1), w, w, [True, True, True])
    s = reduction_plan("sum", (_meta(1365, 768), [0]), [w], A100, 2048)
    assert s is not None
    k = sum(1 for step, _ in s if step == "tmp")

    def shifted(base: int, out: int) -> list:
        return [("out", out) if st == "out" else (st, a + base if st == "free" else a) for st, a in s]
    want = [("out", 0), ("tmp", 3072), ("tmp", 3072), ("tmp", 4193280), ("tmp", 4193280),
            *shifted(4, 1), ("free", 0), *shifted(4 + k, 2), ("free", 1), ("free", 3), ("free", 2)]
    assert norm_backward_plan("native_layer_norm_backward", args, [x, w, w], A100, 2048) == want
    # RMS norm (dbeta is dgamma, `!rms_norm` skips beta's blocks): one block buffer, one sum
    rms = norm_backward_plan("_fused_rms_norm_backward", (x, x, [768], _meta(128, 1024, 1), w, [True, True]),
                             [x, w], A100, 2048)
    assert rms == [("out", 0), ("tmp", 3072), ("tmp", 4193280), *shifted(2, 1), ("free", 0), ("free", 1)]
    # on an H100 (132 SMs) N/32 = 24 < 66 still; N = 4096: 128 >= 54 on an A100: one kernel
    big = _meta(128, 1024, 4096)
    wide = (big, big, [4096], _meta(128, 1024, 1), _meta(128, 1024, 1), _meta(4096), _meta(4096), [True] * 3)
    assert norm_backward_plan("native_layer_norm_backward", wide, [big, _meta(4096), _meta(4096)], A100,
                              2048) == [("out", 0), ("out", 1), ("out", 2)]


def test_layer_norm_backward_copies_a_strided_grad() -> None:
    # LayerNormBackwardKernelImpl passes dY.contiguous(): after the outputs, freed on return
    x, w = _meta(64, 32), _meta(32)
    dy = _meta(32, 64).t()
    args = (dy, x, [32], _meta(64, 1), _meta(64, 1), w, w, [True, True, True])
    assert norm_backward_plan("native_layer_norm_backward", args, [x, w, w], A100, 2048) == [
        ("out", 0), ("out", 1), ("out", 2), ("tmp", 64 * 32 * 4), ("free", 0)]


def test_embedding_bag_forward_order_and_backward_sort_on_the_simulated_h200() -> None:
    """``nn.EmbeddingBag(100, 16, mode="mean")`` on 40 int64 indices in 4 bags (EmbeddingBag.cu).
    Forward ``_embedding_bag_cuda``: ``bag_size`` [4] 32 B, ``offset2bag`` [40] 320 B, ``output``
    [4, 16] 256 B (``max_indices`` ``empty({0})``). Backward (``_embedding_bag_backward``, same
    index dtypes: no promotion): the 0-dim grad of ``sum`` (4 B); ``grad_.contiguous()`` of its
    expand (256 B); ``embedding_bag_backward_cuda_sum_avg``: ``sorted_indices``, ``orig_indices``,
    ``range`` (320 B each; range freed after cub's sort); ``embedding_backward_cuda_kernel``:
    ``grad_weight`` [100, 16] 6,400 B, ``segment_offsets`` 320, a 0-dim int64 8, max_segments =
    min(40, 100) = 40: 320 and 320, 8, max_partial = 40/10 + 40 = 44: 352 B; a bag never takes the
    fused path: ``grad_weight_per_segment`` [44, 16] fp32 2,816 B, freed, then the kernel's locals
    in reverse, orig, sorted, the grad copy. ``mode="max"``: the forward adds ``max_indices`` [4, 16]
    int64 (512 B) last; its backward is the grad copy and ``grad_weight`` (zeros) alone."""
    with simulated_cuda(gpu="H200"):
        idx = torch.arange(40, device="cuda") % 7
        offsets = torch.tensor([0, 10, 20, 30], device="cuda")
        bag = torch.nn.EmbeddingBag(100, 16, mode="mean", device="cuda")
        maxed = torch.nn.EmbeddingBag(100, 16, mode="max", device="cuda")
        torch.cuda.memory._record_memory_history()
        loss = bag(idx, offsets).sum()
        loss.backward()
        del loss
        loss = maxed(idx, offsets).sum()
        loss.backward()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
    got = [(e["action"][0], e["size"]) for e in trace if e["action"] in ("alloc", "free_requested")]
    forward = [("a", 32), ("a", 320), ("a", 256), ("a", 4), ("f", 256), ("a", 4)]  # + sum, its output's
    # release (mean's backward keeps offset2bag and bag_size, not the output), the 0-dim grad
    kernel = [("a", 256), ("a", 320), ("a", 320), ("a", 320), ("f", 320), ("a", 6400), ("a", 320), ("a", 8),
              ("a", 320), ("a", 320), ("a", 8), ("a", 352), ("a", 2816), ("f", 2816), ("f", 352), ("f", 8),
              ("f", 320), ("f", 320), ("f", 8), ("f", 320), ("f", 320), ("f", 320), ("f", 256)]
    graph = [("f", 320), ("f", 32), ("f", 4), ("f", 4)]  # offset2bag, bag_size, the sum and its grad
    maxed_forward = [("a", 32), ("a", 320), ("a", 256), ("a", 512), ("a", 4), ("f", 256), ("a", 4)]
    maxed_backward = [("a", 256), ("a", 6400), ("f", 256)]
    maxed_graph = [("f", 320), ("f", 32), ("f", 512), ("f", 4)]
    assert got == forward + kernel + graph + maxed_forward + maxed_backward + maxed_graph


def test_embedding_bag_backward_promotes_int32_indices_and_names_sparse() -> None:
    """``promoteIndicesAndOffsets``: int32 indices beside int64 offsets are copied to int64 (40 x 8 =
    320 B) before anything else and die last, and the kernels' index buffers are then int64 (the
    sort's three 320 B buffers). ``sparse=True`` runs ``_embedding_bag_sparse_backward``: named."""
    grad, idx, offsets = _meta(4, 16), _meta(40, dtype=torch.int32), _meta(4, dtype=torch.long)
    o2b, size, maxi = _meta(40, dtype=torch.long), _meta(4, dtype=torch.long), _meta(0, dtype=torch.long)
    plan = op_plan("_embedding_bag_backward", (grad, idx, offsets, o2b, size, maxi, 100, False, 0, False, None),
                   [_meta(100, 16)], A100)
    assert plan[:4] == [("tmp", 320), ("tmp", 320), ("tmp", 320), ("tmp", 320)] and plan[-1] == ("free", 0)
    sparse = op_plan("_embedding_bag_backward", (grad, idx, offsets, o2b, size, maxi, 100, False, 0, True, None),
                     [_meta(100, 16)], A100)
    assert sparse == [("out", 0), ("note", EMBEDDING_BAG_UNMODELLED)]
