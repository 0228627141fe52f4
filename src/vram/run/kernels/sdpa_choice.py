"""Which kernel ``scaled_dot_product_attention`` runs on a CUDA GPU, by input and compute
capability: the checks of ``cuda/sdp_utils.cpp`` and ``sdp_utils_cpp.h`` in torch 2.13 (paths
under ``aten/src/ATen/native/transformers/``; the 2.13 headers shipped in the wheel pin them:
``check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>``, no
``supports_mqa``; memory-efficient GQA (PR #191085) came after 2.13).

``select_sdp_backend`` walks ``priority_order``: ``can_use_flash_attention`` — no mask, equal head
dims <= 256, sm80..sm121, fp16/bf16 (fp16 only below sm80), no causal non-square, training with
head dim in (192, 224] (or > 224 with dropout) refused on sm86..sm89/sm120..sm121, GQA with
``enable_gqa``; ``can_use_mem_efficient_attention`` — sm50..sm121, fp16/fp32 (+bf16 from sm80),
head dims divisible by ``minimum_gemm_alignment``, storage offsets aligned on sm80+, equal heads
(no GQA); ``can_use_cudnn_attention``; math.

cuDNN attention: the PyPI 2.13.0 wheel (cu130) pins nvidia-cudnn-cu13 9.20.0.48, so
``check_prefer_cudnn_attention`` (cuDNN > 9.15.0 on sm90/sm100/sm103, minor 0 or 3; off with
``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``) puts cuDNN first on H100/H200/B200, as a real H200 does
(``shared/gpu-truth/h200-2026-11-27``: ``compiled_gpt.py --mode eager``'s attention runs cuDNN's
kernels). What they allocate: `vram.run.kernels.sdpa_cudnn`.
"""
from __future__ import annotations

import math
import os
from typing import Any

import torch

HALF = (torch.float16, torch.bfloat16)
#: cuDNN runtime version of the simulated build (``versionRuntimeCuDNN``): 9.20.0, torch 2.13.0's pin
CUDNN_VERSION = 92000
#: whether ``check_prefer_cudnn_attention`` may put cuDNN first (None: unless the environment sets
#: ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``, read as ``c10::utils::check_env`` does)
PREFER_CUDNN: bool | None = None
_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_DEFAULT_ORDER = [1, 2, 0, 3, 4]


def sdpa_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``scaled_dot_product_attention``'s arguments by name, defaults filled in."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    p: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                         "enable_gqa": False}
    p.update(zip(names, args))
    p.update(kwargs)
    return p


# -- the checks of sdp_utils_cpp.h / cuda/sdp_utils.cpp ---------------------------------------------
def _sm(cc: tuple[int, int], lo: tuple[int, int], hi: tuple[int, int]) -> bool:
    return lo <= cc <= hi


def qkv(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return p["query"], p["key"], p["value"]


def requires_grad(p: dict[str, Any]) -> bool:
    """``input_requires_grad``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in qkv(p))


def deterministic_algorithms() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _dtype_ok(p: dict[str, Any], allowed: tuple[torch.dtype, ...]) -> bool:
    """``check_tensor_dtype``."""
    q, k, v = qkv(p)
    return q.dtype == k.dtype == v.dtype and q.dtype in allowed


def _low_precision(p: dict[str, Any], cc: tuple[int, int]) -> bool:
    """``check_dtypes_low_precision``: fp16/bf16 from sm80, fp16 below."""
    return _dtype_ok(p, HALF if cc[0] >= 8 else (torch.float16,))


def _heads_ok(p: dict[str, Any], supports_gqa: bool, requires_same_num_heads: bool = True) -> bool:
    """``check_batch_size_and_num_heads_dense`` (+ ``check_grouped_query_attention``)."""
    q, k, v = qkv(p)
    if not q.size(0) == k.size(0) == v.size(0):
        return False
    hq, hk, hv = q.size(-3), k.size(-3), v.size(-3)
    if p["enable_gqa"] and supports_gqa:
        if requires_same_num_heads and hk != hv:
            return False
        return hk > 0 and hv > 0 and hq % hk == 0 and (requires_same_num_heads or hq % hv == 0)
    return hq == hk == hv


def _last_stride_1(p: dict[str, Any], ignore_singleton: bool) -> bool:
    """``check_last_dim_stride_equals_1_dense`` (on a GPU the mask too)."""
    q, k, v = qkv(p)
    ok = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton and q.size(-1) == 1)
    mask = p["attn_mask"]
    return ok and (mask is None or mask.stride(-1) == 1)


def _nonzero_seqlens(p: dict[str, Any]) -> bool:
    """``check_nonzero_sequence_lengths_dense``."""
    return p["query"].size(-2) != 0 and p["key"].size(-2) != 0


def _four_dims(p: dict[str, Any]) -> bool:
    """``check_tensor_shapes``."""
    return all(t.dim() == 4 for t in qkv(p))


def minimum_gemm_alignment(dtype: torch.dtype, major: int) -> int:
    """``minimum_gemm_alignment``: elements the mem-efficient GEMMs need head dims divisible by."""
    half = dtype in HALF
    use_tc = major >= 8 or (major >= 7 and half)
    align = 4 if major >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if use_tc else align


def _mask_shape_ok(p: dict[str, Any]) -> bool:
    """``check_attn_mask_shape``."""
    mask, q, k = p["attn_mask"], p["query"], p["key"]
    if mask is None:
        return True
    if mask.requires_grad:
        return False

    def fits(m: int, t: int) -> bool:
        return m in (t, 1)

    if not (fits(mask.size(-2), q.size(2)) and fits(mask.size(-1), k.size(2))):
        return False
    return mask.dim() == 2 or (mask.dim() == 4 and fits(mask.size(0), q.size(0)) and fits(mask.size(1), q.size(1)))


def _flash_checks(p: dict[str, Any], cc: tuple[int, int]) -> list[tuple[str, Any]]:
    q, k, v = qkv(p)
    d = q.size(-1)

    def gt192() -> bool:
        if not (requires_grad(p) and (_sm(cc, (8, 6), (8, 9)) or _sm(cc, (12, 0), (12, 1)))):
            return True
        return d <= 192 or (not p["dropout_p"] > 0 and d > 224)

    def dtypes() -> bool:  # check_dtypes_flash_attention: FA3 adds fp8 on sm90+ when activated
        fa3 = getattr(torch._C, "_get_fa3_sdp_enabled", lambda: False)()
        if cc[0] >= 9 and fa3:
            return _dtype_ok(p, (torch.float8_e4m3fn, *HALF))
        return _low_precision(p, cc)

    return [
        ("check_runtime_disabled_flash", torch.backends.cuda.flash_sdp_enabled),
        ("check_tensor_shapes", lambda: _four_dims(p)),
        ("check_for_attn_mask", lambda: p["attn_mask"] is None),
        ("check_head_dim_size_flash", lambda: d == k.size(-1) == v.size(-1) and d <= 256),
        ("check_flash_attention_hardware_support", lambda: _sm(cc, (8, 0), (12, 1))),
        ("check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120", gt192),
        ("check_flash_causal_non_square_seqlens",
         lambda: not p["is_causal"] or q.size(-2) == k.size(-2)),
        ("check_dtypes_flash_attention", dtypes),
        ("check_batch_size_and_num_heads_dense", lambda: _heads_ok(p, supports_gqa=True)),
        ("check_nonzero_sequence_lengths_dense", lambda: _nonzero_seqlens(p)),
        ("check_last_dim_stride_equals_1_dense", lambda: _last_stride_1(p, ignore_singleton=True)),
    ]


def _efficient_checks(p: dict[str, Any], cc: tuple[int, int]) -> list[tuple[str, Any]]:
    q, k, v = qkv(p)
    align = minimum_gemm_alignment(q.dtype, cc[0])

    def head_dims() -> bool:  # check_head_dim_size_mem_efficient
        dq, dv = q.size(-1), v.size(-1)
        return dq == k.size(-1) and dq % align == 0 and dq > 0 and dv % align == 0 and dv > 0

    def data_ptrs() -> bool:  # check_data_ptr_alignment_mem_efficient: storage offsets on sm80+
        if cc[0] < 8:
            return True
        size = align * q.element_size()
        return all(t.numel() == 0 or t.storage_offset() * t.element_size() % size == 0 for t in (q, k, v))

    dtypes = (torch.float16, torch.float32, torch.bfloat16) if cc[0] >= 8 else (torch.float16, torch.float32)
    return [
        ("check_runtime_disabled_mem_efficient", torch.backends.cuda.mem_efficient_sdp_enabled),
        ("check_mem_efficient_hardware_support", lambda: _sm(cc, (5, 0), (12, 1))),
        ("check_tensor_shapes", lambda: _four_dims(p)),
        ("check_head_dim_size_mem_efficient", head_dims),
        ("check_data_ptr_alignment_mem_efficient", data_ptrs),
        ("check_nonzero_sequence_lengths_dense", lambda: _nonzero_seqlens(p)),
        ("check_last_dim_stride_equals_1_dense", lambda: _last_stride_1(p, ignore_singleton=False)),
        ("check_batch_size_and_num_heads_dense", lambda: _heads_ok(p, supports_gqa=False)),
        ("check_tensor_dtype", lambda: _dtype_ok(p, dtypes)),
    ]


def _cudnn_shapes(p: dict[str, Any], cc: tuple[int, int], version: int) -> bool:
    """``check_cudnn_tensor_shapes`` (head-dim limits before the d=256 rework of PR #185553, which
    the 2.13 binary lacks)."""
    q, k, v = qkv(p)
    s_q, s_k, d_qk, d_v, drop = q.size(2), k.size(2), q.size(3), v.size(3), p["dropout_p"]
    if q.size(0) > 65535 or q.size(1) > 65535 or version < 8903 or (version < 8906 and drop != 0):
        return False
    limit = 256 if version >= 91000 and cc == (9, 0) else 128
    if version >= 91100 and cc[0] == 10 and d_qk == 192 and d_v == 128:
        limit = 192
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or (version < 8906 and s_k % 64):
        return False
    if version < 90000 and (s_q < 64 or (drop != 0 and (s_q % 64 or s_k % 64))):
        return False
    return s_k != 1 and not (s_q == 1 and drop != 0)


def _cudnn_checks(p: dict[str, Any], cc: tuple[int, int], version: int) -> list[tuple[str, Any]]:
    drop = p["dropout_p"]
    return [
        ("cudnn_dropout_9.11_9.13", lambda: not (drop > 0 and 91100 < version < 91400)),
        ("check_runtime_disabled_cudnn", torch.backends.cuda.cudnn_sdp_enabled),
        ("check_tensor_shapes", lambda: _four_dims(p)),
        ("check_cudnn_deterministic", lambda: not deterministic_algorithms()),
        ("check_dtypes_low_precision", lambda: _low_precision(p, cc)),
        ("check_attn_mask_shape", lambda: _mask_shape_ok(p)),
        ("check_cudnn_hardware_support", lambda: _sm(cc, (8, 0), (12, 1))),
        ("check_cudnn_dropout", lambda: drop * 16.0 == math.floor(drop * 16.0)),
        ("check_nonzero_sequence_lengths_dense", lambda: _nonzero_seqlens(p)),
        ("check_last_dim_stride_equals_1_dense", lambda: _last_stride_1(p, ignore_singleton=True)),
        ("check_batch_size_and_num_heads_dense",
         lambda: _heads_ok(p, supports_gqa=True, requires_same_num_heads=False)),
        ("check_cudnn_tensor_shapes", lambda: _cudnn_shapes(p, cc, version)),
    ]


def sdpa_rejections(p: dict[str, Any], major: int = 9, minor: int = 0,
                    cudnn_version: int | None = None, *,
                    skipped: frozenset[str] = frozenset()) -> dict[str, str | None]:
    """For each fused backend, the first ``sdp_utils.cpp`` check that refuses `p` (None: usable);
    the checks named in `skipped` are left out (those nested inputs do not run)."""
    cc, version = (major, minor), CUDNN_VERSION if cudnn_version is None else cudnn_version
    out: dict[str, str | None] = {}
    for name, checks in (("flash", _flash_checks(p, cc)), ("efficient", _efficient_checks(p, cc)),
                         ("cudnn", _cudnn_checks(p, cc, version))):
        out[name] = next((check for check, ok in checks if check not in skipped and not ok()), None)
    return out


def select_sdpa_backend(p: dict[str, Any], major: int = 9, minor: int = 0, *,
                        cudnn_version: int | None = None, prefer_cudnn: bool | None = None) -> str:
    """"flash", "efficient", "cudnn" or "math": ``select_sdp_backend`` on a device of this capability."""
    q, k, v = qkv(p)
    if any(t.is_nested for t in (q, k, v)):
        return "math"  # nested inputs: not modelled, PyTorch's own composite runs
    version = CUDNN_VERSION if cudnn_version is None else cudnn_version
    prefer = PREFER_CUDNN if prefer_cudnn is None else prefer_cudnn
    if prefer is None:
        prefer = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED") != "1"
    enabled = {"math": torch.backends.cuda.math_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
               "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
               "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
    if not any(enabled.values()):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely "
                           "due to turning off both the math kernel and the fused kernels.")
    order = list(torch._C._get_sdp_priority_order())
    # check_prefer_cudnn_attention (a CUDA 13 build): cuDNN > 9.15.0 on sm90/sm100/sm103
    if prefer and version > 91500 and major in (9, 10) and minor in (0, 3) and order == _DEFAULT_ORDER:
        order = [3, 1, 2, 0, 4]
    rejected = sdpa_rejections(p, major, minor, version)
    for backend in (_NAMES[i] for i in order):
        if backend == "math":
            if enabled["math"]:
                return "math"
        elif backend == "overrideable":
            if torch._C._get_overrideable_sdp_enabled():
                raise RuntimeError("Invalid backend")
        elif rejected[backend] is None:
            return backend
    raise RuntimeError("No available kernel. Aborting execution.")
