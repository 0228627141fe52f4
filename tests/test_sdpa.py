"""`vram.run.kernels.sdpa`: the CUDA backend of ``scaled_dot_product_attention`` and what its kernels allocate.

Expected choices cite the ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (and
``sdp_utils_cpp.h``) check that decides them; expected bytes are derived by hand from the kernels'
sources (``flash_attn/flash_api.cpp`` ``mha_fwd``/``mha_bwd``, ``attention_backward.cu``,
``attention.cu``, ``mem_eff_attention/kernel_backward.h``, ``attention.cpp``'s math path), never
from printing vram's output. Every size below is a multiple of 512, so the caching allocator
charges it exactly (spec §4).
"""
from __future__ import annotations

import textwrap

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from vram.run.kernels.sdpa_choice import sdpa_args, sdpa_rejections, select_sdpa_backend  # noqa: E402
from vram.run.runtime import run_script, simulated_cuda  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
S = 2 * 8 * 64 * 64 * 4          # one [2, 8, 64, 64] float32 tensor: 262,144 B


def _params(dtype=BF16, d=64, hq=8, hk=8, sq=64, sk=64, mask=False, dropout=0.0, causal=False, grad=False,
            gqa=False, offset=0, transposed=False):
    def make(h, s):
        t = torch.empty(offset + 2 * h * s * d, dtype=dtype, device="meta")[offset:].view(2, h, s, d)
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2) if transposed else t
        return t.requires_grad_(grad)

    q, k, v = make(hq, sq), make(hk, sk), make(hk, sk)
    kwargs = {"attn_mask": torch.zeros(sq, sk, dtype=dtype, device="meta") if mask else None,
              "dropout_p": dropout, "is_causal": causal, "enable_gqa": gqa}
    return sdpa_args((q, k, v), kwargs)


FLASH_DTYPE, HEADS = "check_dtypes_flash_attention", "check_batch_size_and_num_heads_dense"
GT192 = "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120"
# (capability, inputs, backend chosen, {backend: the check that refuses it})
TABLE = [
    ((9, 0), {}, "flash", {}),
    # check_dtypes_flash_attention: fp16/bf16 only; mem-efficient takes fp32 (can_use_mem_efficient_attention)
    ((9, 0), {"dtype": F32}, "efficient", {"flash": FLASH_DTYPE}),
    # the issue: mem-efficient instantiates check_batch_size_and_num_heads_dense<false> (no GQA in 2.13)
    ((9, 0), {"dtype": F32, "hk": 2, "gqa": True, "causal": True}, "math",
     {"flash": FLASH_DTYPE, "efficient": HEADS}),
    # flash: check_batch_size_and_num_heads_dense<true> -> check_grouped_query_attention (8 % 2 == 0)
    ((9, 0), {"hk": 2, "gqa": True}, "flash", {}),
    ((9, 0), {"hk": 1, "gqa": True}, "flash", {}),                 # MQA is GQA with one KV head
    ((9, 0), {"hk": 2}, "math", {"flash": HEADS, "efficient": HEADS}),   # no enable_gqa: same heads needed
    ((9, 0), {"hk": 3, "gqa": True}, "math", {"flash": HEADS, "efficient": HEADS}),  # 8 % 3 != 0
    ((9, 0), {"mask": True}, "efficient", {"flash": "check_for_attn_mask"}),
    ((9, 0), {"causal": True, "sq": 32}, "efficient", {"flash": "check_flash_causal_non_square_seqlens"}),
    ((9, 0), {"causal": True}, "flash", {}),
    ((9, 0), {"dropout": 0.1}, "flash", {}),
    ((9, 0), {"d": 264}, "efficient", {"flash": "check_head_dim_size_flash"}),       # <= 256
    # check_head_dim_size_mem_efficient: minimum_gemm_alignment is 4 for fp32 on sm80+ ...
    ((9, 0), {"dtype": F32, "d": 62}, "math", {"efficient": "check_head_dim_size_mem_efficient"}),
    # ... but 1 on sm75, where fp32 has no tensor cores (use_tensor_cores)
    ((7, 5), {"dtype": F32, "d": 62}, "efficient", {"flash": "check_flash_attention_hardware_support"}),
    ((7, 5), {"dtype": F16}, "efficient", {"flash": "check_flash_attention_hardware_support"}),
    # fp16 on sm75 uses tensor cores: 128 / 16 = 8
    ((7, 5), {"dtype": F16, "d": 60}, "math", {"efficient": "check_head_dim_size_mem_efficient"}),
    # bf16 below sm80: less_than_sm80_mem_efficient_dtypes = {half, float}
    ((7, 5), {}, "math", {"flash": "check_flash_attention_hardware_support", "efficient": "check_tensor_dtype"}),
    ((6, 1), {"dtype": F16, "d": 60}, "efficient", {}),               # sm6x: no tensor cores, alignment 1
    ((8, 0), {"d": 200, "grad": True}, "flash", {}),
    ((8, 6), {"d": 200}, "flash", {}),                                # the sm86 rule is about training
    ((8, 6), {"d": 200, "grad": True}, "efficient", {"flash": GT192}),
    ((8, 6), {"d": 256, "grad": True}, "flash", {}),                   # > 224 without dropout is fine
    ((8, 6), {"d": 256, "grad": True, "dropout": 0.1}, "efficient", {"flash": GT192}),
    ((8, 9), {"dtype": F16, "d": 224, "grad": True}, "efficient", {"flash": GT192}),
    ((12, 0), {"d": 200, "grad": True}, "efficient", {"flash": GT192}),
    ((9, 0), {"dtype": torch.float64}, "math", {"flash": FLASH_DTYPE, "efficient": "check_tensor_dtype"}),
    # check_data_ptr_alignment_mem_efficient: storage_offset * element_size % 16 on sm80+ only
    ((8, 0), {"dtype": F32, "offset": 1}, "math", {"efficient": "check_data_ptr_alignment_mem_efficient"}),
    ((7, 5), {"dtype": F32, "offset": 1}, "efficient", {}),
    ((9, 0), {"transposed": True}, "math", {"flash": "check_last_dim_stride_equals_1_dense",
                                            "efficient": "check_last_dim_stride_equals_1_dense"}),
]


@pytest.mark.parametrize("cc, inputs, backend, refused", TABLE)
def test_backend_choice_follows_sdp_utils(cc, inputs, backend, refused) -> None:
    # the default priority order, as without check_prefer_cudnn_attention (TORCH_CUDNN_SDPA_DEPRIORITIZED=1)
    p = _params(**inputs)
    assert select_sdpa_backend(p, *cc, prefer_cudnn=False) == backend
    reasons = sdpa_rejections(p, *cc)
    for name, check in refused.items():
        assert reasons[name] == check
    if backend != "math":
        assert reasons[backend] is None


@pytest.mark.parametrize("cc, version, inputs, backend", [
    ((9, 0), 92000, {"d": 128}, "cudnn"),
    ((9, 0), 92000, {"hk": 2, "gqa": True}, "cudnn"),          # <true /*gqa*/, false /*same heads*/>
    ((10, 0), 92000, {}, "cudnn"),
    ((8, 0), 92000, {}, "flash"),                              # check_prefer_cudnn_attention: sm9x/sm10x
    ((9, 0), 91500, {}, "flash"),                              # needs cuDNN > 9.15.0
    ((9, 0), 92000, {"dtype": F32}, "efficient"),              # check_dtypes_low_precision
    ((9, 0), 92000, {"dropout": 0.1}, "flash"),                # check_cudnn_dropout: a multiple of 1/16
    ((9, 0), 92000, {"dropout": 0.125}, "cudnn"),
    ((9, 0), 92000, {"d": 264}, "efficient"),                  # check_cudnn_tensor_shapes: <= 256 on sm90
])
def test_cudnn_first_when_preferred(cc, version, inputs, backend) -> None:
    assert select_sdpa_backend(_params(**inputs), *cc, cudnn_version=version, prefer_cudnn=True) == backend


@pytest.mark.parametrize("cc, deprioritized, backend", [
    ((9, 0), None, "cudnn"), ((10, 0), None, "cudnn"), ((10, 3), None, "cudnn"),
    ((10, 1), None, "flash"), ((8, 0), None, "flash"), ((12, 0), None, "flash"),   # major 9/10, minor 0/3
    ((9, 0), "1", "flash"), ((9, 0), "0", "cudnn"),   # c10::utils::check_env: only "1" is true
])
def test_cudnn_preferred_by_default_on_hopper_and_blackwell(monkeypatch, cc, deprioritized, backend) -> None:
    # check_prefer_cudnn_attention of a build with cuDNN 9.20 (> 9.15.0), as the 2.13 wheel pins and
    # as a real H200 shows (shared/gpu-truth/h200-2026-11-27: compiled_gpt --mode eager runs cuDNN's)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    if deprioritized is not None:
        monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", deprioritized)
    assert select_sdpa_backend(_params(), *cc) == backend


def test_no_kernel_when_only_an_unusable_one_is_enabled() -> None:
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError, match="No available kernel"):
        select_sdpa_backend(_params(dtype=F32), 9, 0)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):              # forced, even when not preferred
        assert select_sdpa_backend(_params(), 9, 0) == "cudnn"


@pytest.fixture
def flash_first(monkeypatch):  # type: ignore[no-untyped-def]
    """The priority order without cuDNN first (``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``), for tests of
    the flash and memory-efficient kernels on the default sm90 device."""
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")


def _warm_cublas() -> None:
    """The main thread's and the autograd thread's cuBLAS workspaces, out of the way."""
    w = torch.randn(8, 8, device="cuda", requires_grad=True)
    (w @ w).sum().backward()


def test_issue_gqa_float32_runs_and_allocates_like_the_math_path() -> None:
    # q [2,8,64,64], k/v [2,2,64,64] fp32, causal, enable_gqa: math (see TABLE). attention.cpp
    # _scaled_dot_product_attention_math, each buffer S = 262,144 B unless said:
    #   query = q * sqrt(scale)                       S   (saved by bmm)
    #   causal mask: ones bool 4 KiB -> tril, where(mask, 0., -inf) fp32 [64,64] = 16,384 B
    #   repeat_interleave(k), repeat_interleave(v)     S + S   (v's saved by the second bmm)
    #   k_rep^T * sqrt(scale)                          S   (saved by bmm)
    #   bmm -> attn, add_(mask) in place               S
    #   _safe_softmax: softmax S, isneginf 65,536, all(keepdim) 1,024, scalar 0 (512) -> peak
    #   matmul(attn, v_rep) = the output               S   (attn's storage freed before it)
    peak = 6 * S + 16384 + 65536 + 1024 + 512
    with simulated_cuda():
        _warm_cublas()
        q = torch.randn(2, 8, 64, 64, device="cuda", requires_grad=True)
        k, v = (torch.randn(2, 2, 64, 64, device="cuda", requires_grad=True) for _ in range(2))
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.cuda.max_memory_allocated() - a0 == peak
        # kept: query, k_rep^T*s, softmax, v_rep (saved) and the output; mask and k_rep die
        assert torch.cuda.memory_allocated() - a0 == 5 * S
        g = torch.ones_like(o)
        a1 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o.backward(g)
        # softmax backward holds the incoming gradient S, its grad_input S and the product
        # grad * output S (SoftMax.cu softmax_backward_cuda_out) at once
        assert torch.cuda.max_memory_allocated() - a1 == 3 * S
        # the four saved S buffers go; q.grad S, k.grad and v.grad 65,536 each (summed over groups)
        assert torch.cuda.memory_allocated() - a1 == -4 * S + S + 2 * 65536
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
        q.grad = k.grad = v.grad = None
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.sum().backward()                                   # the issue's reproduction
        assert k.grad.shape == (2, 2, 64, 64) and v.grad.shape == (2, 2, 64, 64)


def test_issue_reproduction_under_vram_run(tmp_path, capsys) -> None:
    script = tmp_path / "gqa.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn.functional as F
        q = torch.randn(2, 8, 64, 64, device="cuda", requires_grad=True)
        k = torch.randn(2, 2, 64, 64, device="cuda", requires_grad=True)
        v = torch.randn(2, 2, 64, 64, device="cuda", requires_grad=True)
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        print(tuple(q.grad.shape), tuple(k.grad.shape), tuple(v.grad.shape))
    """))
    assert run_script(str(script)) == 0
    assert "(2, 8, 64, 64) (2, 2, 64, 64) (2, 2, 64, 64)" in capsys.readouterr().out


def test_gqa_bf16_flash_expands_dk_dv_in_backward(flash_first) -> None:
    # mha_fwd: out 131,072 (bf16 [2,8,64,64]), softmax_lse fp32 [2,8,64] 4,096, rng_state uint64[2]
    # and _unused uint64 (512 each); num_splits_heuristic(16 blocks, 264, 1 key block) = 1 split
    fwd = 131072 + 4096 + 512 + 512
    with simulated_cuda():
        q = torch.randn(2, 8, 64, 64, device="cuda", dtype=BF16, requires_grad=True)
        k, v = (torch.randn(2, 2, 64, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(2))
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.cuda.max_memory_allocated() - a0 == fwd
        assert torch.cuda.memory_allocated() - a0 == fwd          # lse and the rng state are saved
        loss = o.sum()
        a1 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        # the loss's gradient (512); _flash_attention_backward: grad_out.contiguous() (sum's stride-0
        # gradient, BSHD) 131,072 and out.contiguous() (a BHSD-contiguous output is not BSHD-
        # contiguous) 131,072; mha_bwd: dq 131,072, dk and dv 32,768 each, softmax_d fp32
        # [2,8,128] 8,192, dq_accum fp32 [2,128,8,64] 524,288, dk/dv expanded to 8 heads 131,072 each
        peak = 512 + 2 * 131072 + 131072 + 2 * 32768 + 8192 + 524288 + 2 * 131072
        assert torch.cuda.max_memory_allocated() - a1 == peak
        # kept: the gradients; gone: lse and the rng state saved for backward
        assert torch.cuda.memory_allocated() - a1 == 131072 + 2 * 32768 - (4096 + 512 + 512)
        assert k.grad.shape == (2, 2, 64, 64) and q.grad.dtype == BF16


def test_gqa_decode_swaps_groups_into_the_split_heuristic(flash_first) -> None:
    # q [1,32,1,128], k/v [1,8,4096,128] bf16: mha_fwd's seqlenq_ngroups_swapped (seqlen_q == 1,
    # 32 > 8 heads, no dropout) runs 8 heads x 4 queries; num_splits_heuristic(8 blocks, 264 SM slots,
    # 32 key blocks of 128): efficiency 8s/264 peaks at s = 32 and the first split count reaching 85%
    # of it is 32 (28..31 give the same 2 blocks per split as 27). softmax_lse_accum fp32
    # [32,1,8,4] 4,096 and out_accum fp32 [32,1,8,4,128] 524,288, freed at the end.
    out, lse = 32 * 128 * 2, 512                  # out bf16 8,192; softmax_lse fp32 [1,8,4] 128 B
    with simulated_cuda():
        q = torch.randn(1, 32, 1, 128, device="cuda", dtype=BF16)
        k, v = (torch.randn(1, 8, 4096, 128, device="cuda", dtype=BF16) for _ in range(2))
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert torch.cuda.max_memory_allocated() - a0 == out + lse + 4096 + 524288 + 512 + 512
        assert torch.cuda.memory_allocated() - a0 == out
        del o


def test_efficient_float32_backward_workspace() -> None:
    # q, k, v [2,8,64,64] fp32: efficient (TABLE). Forward: res S, logsumexp fp32 [2,8,64] 4,096
    # (ceil(64/32)*32); philox seed/offset are CPU tensors without dropout.
    with simulated_cuda():
        q, k, v = (torch.randn(2, 8, 64, 64, device="cuda", requires_grad=True) for _ in range(3))
        a0 = torch.cuda.memory_allocated()
        o = F.scaled_dot_product_attention(q, k, v)
        assert torch.cuda.memory_allocated() - a0 == S + 4096
        loss = o.sum()
        a1 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        # _efficient_attention_backward: loss gradient 512; grad_out.contiguous() S; grad_q/k/v 3 S;
        # kernel AttentionBackwardKernel<Sm80, float, 64, 64, kMaxK 64> does not compute delta, so
        # (grad_out * out) S, .sum(-1) [2,64,8] 4,096, .transpose().contiguous() 4,096 -> peak;
        # then the workspace: 2*8 * align4(ceil(64/64) * ceil(64/64) * (4 + 64*64)) * 4 = 262,400 B
        # (262,656 allocated), after the product and the sum are gone
        assert torch.cuda.max_memory_allocated() - a1 == 512 + 5 * S + 4096 + 4096
        # grads kept (AccumulateGrad re-lays the BSHD gradients out like q: a copy, the original freed)
        assert torch.cuda.memory_allocated() - a1 == 3 * S - 4096
        assert q.grad.is_contiguous()


def test_efficient_head_dim_over_128_accumulates_in_float32(flash_first) -> None:
    # bf16 head dim 160 with a mask: flash refuses the mask, efficient runs cutlassF's
    # 32x128 kMaxK=65536 kernel (not kSingleValueIteration): kNeedsOutputAccumulatorBuffer, an fp32
    # [1,128,4,160] 327,680 B buffer beside res bf16 163,840; no logsumexp without grad (0 B)
    with simulated_cuda():
        q, k, v = (torch.randn(1, 4, 128, 160, device="cuda", dtype=BF16) for _ in range(3))
        mask = torch.zeros(1, 1, 128, 128, device="cuda", dtype=BF16)   # aligned: not padded
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.cuda.max_memory_allocated() - a0 == 163840 + 327680
        assert torch.cuda.memory_allocated() - a0 == 163840
        del o


def test_cudnn_charges_its_outputs_not_its_workspace() -> None:
    # _cudnn_attention_forward: cudnn_seed and cudnn_offset (int64 scalars on the GPU, 512 each),
    # then run_cudnn_SDP_fprop: o like q (bf16 [2,8,128,64] 262,144) and, when training,
    # softmaxstats fp32 [2,8,128,1] 8,192. Its workspace size comes from cuDNN: not charged.
    with simulated_cuda(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        q, k, v = (torch.randn(2, 8, 128, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
        a0 = torch.cuda.memory_allocated()
        o = F.scaled_dot_product_attention(q, k, v)
        assert torch.cuda.memory_allocated() - a0 == 512 + 512 + 262144 + 8192
        assert o.shape == q.shape


def test_efficient_bf16_backward_workspace_is_the_peak(flash_first) -> None:
    # bf16 [2,8,64,64] with a (non-trainable) mask: efficient. Backward kernel: the first of
    # dispatch_cutlassB_bf16_sm80 with kMaxK >= 64 is 64x64 k64 with preload: kOutputInRF (64 <= 64),
    # so no dK/dV staging, and it computes delta itself (fp32 [2,8,64] 4,096). Split keys are on
    # (sm80+): kNeedsAccumGradQ, workspace 2*8 * align4(1 * 1 * (4 + 64*64)) * 4 = 262,400 B
    # (262,656 allocated). Loss gradient 512, grad_out.contiguous() 131,072, grads 3 x 131,072.
    with simulated_cuda():
        q, k, v = (torch.randn(2, 8, 64, 64, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
        mask = torch.zeros(64, 64, device="cuda", dtype=BF16)    # strides (64, 1): aligned_tensor<8>
        a0 = torch.cuda.memory_allocated()
        loss = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()
        assert torch.cuda.memory_allocated() - a0 == 131072 + 4096 + 512     # res, logsumexp, loss
        a1 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        assert torch.cuda.max_memory_allocated() - a1 == 512 + 131072 + 3 * 131072 + 4096 + 262656


def test_flash_dropout_replaces_its_rng_state() -> None:
    # mha_fwd with dropout: rng_state uint64[2] and _unused, then rng_state allocated again once the
    # generator is locked (the first one freed); no split-KV with dropout
    with simulated_cuda():
        q, k, v = (torch.randn(2, 8, 64, 64, device="cuda", dtype=BF16) for _ in range(3))
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        assert torch.cuda.max_memory_allocated() - a0 == 131072 + 4096 + 3 * 512
        assert torch.cuda.memory_allocated() - a0 == 131072
        del o
