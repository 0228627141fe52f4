"""`vram.run.kernels.reductions`: the scratch CUDA reduction kernels take from the caching allocator.

Expected bytes are worked by hand from ``aten/src/ATen/native/cuda/Reduce.cuh`` (``setReduceConfig``,
``ReduceConfig::global_memory_size``/``semaphore_size``, ``gpu_reduce_kernel``) and
``TensorIterator.cpp`` (``reorder_dimensions``, ``coalesce_dimensions``, ``split``), each step in
the comments; the recorded case comes from ``shared/traces/cs336-s-mem.pickle``.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from paths import RECORDINGS as TRACES  # noqa: E402
from vram.devices.gpus import max_threads_per_sm  # noqa: E402
from vram.replay.loader import load_snapshot  # noqa: E402
from vram.run.kernels.reductions import build_iter, reduction_plan, staging_sizes  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

A100, H100 = 108, 132


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, device="meta", dtype=dtype)


def test_full_sum_of_the_recorded_attention_output() -> None:
    # sum() of 8x4096x16 fp32 = 524,288 elements, one output, contiguous: 1-D after coalescing,
    # reduced on the fastest dim; vectorised dim0 = 524,288/4; block 512x1 (dim1 = 1);
    # step_input 512 -> values/thread 1,024 >= min(1*16, 256): split across warps (x1);
    # blocks/SM 2048/512 = 4, target 108*4 = 432, grid 1; ctas = max(min(432, 1024/16 = 64),
    # 1024/256 = 4) = 64; buffer 4 B * 1 output * 64 = 256, semaphores 4 * grid 1 = 4.
    x = _meta(8, 4096, 16)
    plan = reduction_plan("sum", (x,), [_meta()], A100, 2048)
    assert plan == [("out", 0), ("tmp", 256), ("tmp", 4), ("free", 1), ("free", 0)]
    # on an H100 the target is 132*4 = 528: still min(528, 64) = 64 blocks per output
    assert reduction_plan("sum", (x,), [_meta()], H100, 2048) == plan


def test_the_recorded_sum_allocates_what_the_a100_did() -> None:
    events = load_snapshot(TRACES / "cs336-s-mem.pickle")["device_traces"][0]
    recorded = [(e["action"], e["size"]) for e in events[26:33]]  # output.sum(): out, buffer, semaphores
    with simulated_cuda(gpu="A100-80GB"):
        out = torch.randn(8, 4096, 16, device="cuda")
        torch.cuda.memory._record_memory_history()
        out.sum()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
    mine = [(e["action"], e["size"]) for e in trace if e["action"] in ("alloc", "free_requested", "free_completed")]
    assert mine[:7] == recorded == [("alloc", 4), ("alloc", 256), ("alloc", 4), ("free_requested", 4),
                                    ("free_completed", 4), ("free_requested", 256), ("free_completed", 256)]


@pytest.mark.parametrize(("sms", "threads", "blocks"), [(108, 2048, 432), (132, 2048, 528), (82, 1536, 246)])
def test_sm_count_and_threads_per_sm_set_the_blocks_per_output(sms, threads, blocks) -> None:
    # sum() of 2**24 fp32: block 512, values/thread 2**24/512 = 32,768; ctas = max(min(target,
    # 32768/16 = 2048), 32768/256 = 128) = target = sms * (threads // 512)
    plan = reduction_plan("sum", (_meta(2**24),), [_meta()], sms, threads)
    assert blocks == sms * (threads // 512)
    assert plan[1:3] == [("tmp", 4 * blocks), ("tmp", 4)]


def test_threads_per_sm_by_compute_capability() -> None:
    # CUDA C Programming Guide, technical specifications: resident threads per SM
    assert [max_threads_per_sm(*cc) for cc in ((7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0))] == \
        [2048, 1024, 2048, 1536, 1536, 2048, 1536]


def test_column_sum_stages_one_slot_per_thread_and_vector() -> None:
    # sum(dim=0) of [65536, 64] fp32: reorder puts the reduced dim first (output stride 0), no
    # coalescing; not on the fastest striding dim: dim0 = 64 outputs, dim1 = 65,536; the input's
    # fastest stride is 4 B: output vec 4 (address, 64 and 64 all divisible) -> dim0 16, max threads
    # 512/4 = 128: block 16x8; output split 16; values/thread 65,536 >= min(8*16, 256): split warps
    # (step_input 8); grid div_up(64/4, 16) = 1; blocks/SM 2048/128 = 16, target 1,728;
    # values/thread 8,192: ctas = max(min(1728, 512), 32) = 512;
    # buffer 4 * 64 * 512 * block.x 16 * vec 4 = 8,388,608; semaphores 4.
    x = _meta(65536, 64)
    it = build_iter([65536, 64], [64, 1], 4, 0, [([0, 1], 4)], {0})
    assert (it.shape, it.strides) == ([65536, 64], [[0, 4], [256, 4]])
    assert staging_sizes(it, 4, 4, A100, 2048) == (8388608, 4)
    assert reduction_plan("sum", (x, [0]), [_meta(64)], A100, 2048)[1:3] == [("tmp", 8388608), ("tmp", 4)]
    # a storage offset of 2 elements halves the output vector (address 2 is not a multiple of 4):
    # dim0 32, max threads 256: block 32x8; grid div_up(32, 32) = 1; step_input 8 -> 8,192 values
    # per thread; target 108 * 2048/256 = 864: ctas = max(min(864, 512), 32) = 512;
    # buffer 4 * 64 * 512 * block.x 32 * vec 2 = 8,388,608 again (block.x * vec is 64 both ways)
    y = torch.empty(65536 * 64 + 2, device="meta")[2:].view(65536, 64)
    assert reduction_plan("sum", (y, [0]), [_meta(64)], A100, 2048)[1:3] == [("tmp", 8388608), ("tmp", 4)]
    # with 256 outputs instead: vec 4 -> dim0 64, block 32x4 (128 threads), grid div_up(64, 32) = 2,
    # target 1,728, step_input 4 -> 16,384/thread: ctas = max(min(864, 1024), 64) = 864;
    # buffer 4 * 256 * 864 * 32 * 4 = 113,246,208, semaphores 4 * 2 = 8
    z = _meta(65536, 256)
    assert reduction_plan("sum", (z, [0]), [_meta(256)], A100, 2048)[1:3] == [("tmp", 113246208), ("tmp", 8)]


def test_max_along_a_dim_stages_value_index_pairs() -> None:
    # max(dim=1) of [4, 2**20] fp32: MaxOps' arg_t pair<float, int64_t> = 16 B; vectorised dim0
    # 2**18, dim1 4: block 128x4; values/thread 2**20/128 = 8,192 >= 64: split warps; grid 4;
    # target 432; values/thread 2,048: ctas = max(min(108, 128), 8) = 108; buffer 16*4*108 = 6,912,
    # semaphores 4 * grid 4 = 16; both outputs (values, indices) come first.
    plan = reduction_plan("max", (_meta(4, 2**20), 1), [_meta(4), _meta(4, dtype=torch.int64)], A100, 2048)
    assert plan == [("out", 0), ("out", 1), ("tmp", 6912), ("tmp", 16), ("free", 1), ("free", 0)]


def test_small_and_row_reductions_stage_nothing() -> None:
    # RMSNorm's mean(-1) over [512, 2560]: block 32x16, 80 values/thread < 256: no split across
    # warps, hence no global reduction (the recorded k_run/s_bf16 programs have none)
    assert reduction_plan("mean", (_meta(512, 2560), [-1], True), [_meta(512, 1)], H100, 2048) == [("out", 0)]
    assert reduction_plan("sum", (_meta(1000),), [_meta()], A100, 2048) == [("out", 0)]


def test_integer_sum_converts_its_input_to_int64_first() -> None:
    # make_reduction_from_out_ty: in_dtype = out_dtype (int64) != bool: self.to(kLong), 8 B each,
    # allocated after the output and freed when sum returns; 1,000 values stage nothing
    x = _meta(1000, dtype=torch.bool)
    assert reduction_plan("sum", (x,), [_meta(dtype=torch.int64)], A100, 2048) == \
        [("out", 0), ("tmp", 8000), ("free", 0)]
    # half -> float32 is reduced in one kernel (gpu_lowp_to_f32): no copy
    h = _meta(1000, dtype=torch.float16)
    assert reduction_plan("sum", (h,), [_meta()], A100, 2048) == [("out", 0)]


def test_over_2_31_elements_launch_in_halves_with_an_accumulation_buffer() -> None:
    # sum() of 2**31 bf16: numel > INT32_MAX -> split dim 0 in halves of 2**30 (each 32-bit
    # indexable); bf16 -> bf16 cannot accumulate in the output: AccumulationBuffer of
    # sizeof(float) * 1 output element first. Each half: block 512, values/thread 2**21,
    # ctas = max(min(432, 2**17), 2**13) = 8,192: buffer 4 * 8192 = 32,768, semaphores 4.
    x = _meta(2**31, dtype=torch.bfloat16)
    plan = reduction_plan("sum", (x,), [_meta(dtype=torch.bfloat16)], A100, 2048)
    assert plan == [("out", 0), ("tmp", 4),
                    ("tmp", 32768), ("tmp", 4), ("free", 2), ("free", 1),
                    ("tmp", 32768), ("tmp", 4), ("free", 4), ("free", 3), ("free", 0)]


def test_a_simulated_sum_peaks_with_its_staging_buffer() -> None:
    # sum() of 2**24 fp32 on an H100 (132 SMs): 528 blocks -> 2,112 B buffer (2,560 in the
    # allocator's 512-byte rounding) + 4 B semaphores (512) above the 64 MiB input and 4 B output
    with simulated_cuda(gpu="H100"):
        x = torch.empty(2**24, device="cuda")
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        x.sum()
        assert torch.cuda.max_memory_allocated() - base == 512 + 2560 + 512
        assert torch.cuda.memory_allocated() == base


@pytest.mark.parametrize(("base", "scratch"), [(2, 8), (0.5, 8), (2j, 16), (1, 0), (1.0, 0)])
def test_pow_of_a_scalar_base_makes_a_cuda_tensor_of_it(base, scratch) -> None:
    # pow_Scalar_out (native/Pow.cpp): base 1 -> out.fill_(1); else pow_out(out,
    # wrapped_scalar_tensor(base, exp.device()), exp): a 0-dim CUDA double / int64 / complex
    # double (scalar_to_tensor, ScalarOps.h) after the output, freed on return
    with simulated_cuda(gpu="A100-80GB"):
        x = torch.randn(1024, device="cuda", dtype=torch.complex64 if isinstance(base, complex) else torch.float32)
        torch.cuda.memory._record_memory_history()
        y = base ** x
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        assert y.shape == x.shape
    mine = [(e["action"], e["size"]) for e in trace if e["action"] in ("alloc", "free_requested")]
    out = [("alloc", x.numel() * x.element_size())]
    assert mine == out + ([("alloc", scratch), ("free_requested", scratch)] if scratch else [])


def test_foreach_norm_fast_path_takes_its_partials_first() -> None:
    # ForeachReduceOp.cu foreach_tensor_norm_cuda_internal: output_per_tensor = zeros(ntensors *
    # max_chunks_per_tensor) in opmath (fp32 for bf16), chunks of 65,536 elements
    # (MultiTensorApply.cuh kChunkSize); then one 0-dim output per tensor; partials freed on return.
    from vram.run.kernels.plan import foreach_norm_plan

    grads = [_meta(3_000_000), _meta(100), _meta(256, 256)]
    outs = [[_meta(), _meta(), _meta()]]
    # 3,000,000 / 65,536 -> 46 chunks: 3 x 46 x 4 B
    assert foreach_norm_plan("_foreach_norm", (grads, 2.0), outs) == [("tmp", 552), ("out", 0), ("free", 0)]
    bf16 = [g.to(torch.bfloat16) for g in grads]
    assert foreach_norm_plan("_foreach_powsum", (bf16, 1), outs) == [("tmp", 552), ("out", 0), ("free", 0)]
    # the slow path (linalg_vector_norm per tensor): another ord, mixed dtypes, a strided view
    assert foreach_norm_plan("_foreach_norm", (grads, 3.0), outs) is None
    assert foreach_norm_plan("_foreach_powsum", (grads, float("inf")), outs) is None
    assert foreach_norm_plan("_foreach_norm", ([grads[0], bf16[1]], 2.0), [[_meta(), _meta()]]) is None
    assert foreach_norm_plan("_foreach_norm", ([grads[2][:, :7]], 2.0), [[_meta()]]) is None


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_clip_grad_norm_allocates_the_partials_before_the_norms(backend: str) -> None:
    with simulated_cuda(gpu="A100-80GB", backend=backend):
        ps = [torch.nn.Parameter(torch.empty(n, device="cuda")) for n in (3_000_000, 100, 70_000)]
        for p in ps:
            p.grad = torch.empty_like(p)
        torch.cuda.memory._record_memory_history()
        torch.nn.utils.clip_grad_norm_(ps, 1.0)
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
    sizes = [(e["action"], e["size"]) for e in trace if e["action"] in ("alloc", "free_completed")]
    # _foreach_norm: partials, three norms, partials freed; then torch.stack of the norms
    assert sizes[:6] == [("alloc", 552), ("alloc", 4), ("alloc", 4), ("alloc", 4), ("free_completed", 552),
                         ("alloc", 12)]
