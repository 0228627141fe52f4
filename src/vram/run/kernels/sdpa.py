"""``scaled_dot_product_attention`` on the simulated GPU: which CUDA kernel runs, what it allocates.

Rules of torch 2.13 (paths under ``aten/src/ATen/native/transformers/``). Version notes: the 2.13
headers shipped in the wheel (``sdp_utils_cpp.h``: ``check_batch_size_and_num_heads_dense<
supports_gqa, requires_same_num_heads>``, no ``supports_mqa``) and the warning strings of its
``libtorch_cuda.so`` pin the checks below; memory-efficient GQA (PR #191085) came after 2.13.

* **Choice** (``cuda/sdp_utils.cpp``: ``select_sdp_backend`` walks ``priority_order``):
  ``can_use_flash_attention`` — no mask, equal head dims <= 256, sm80..sm121, fp16/bf16 (fp16 only
  below sm80), no causal non-square, training with head dim in (192, 224] (or > 224 with dropout)
  refused on sm86..sm89/sm120..sm121, GQA with ``enable_gqa``; ``can_use_mem_efficient_attention``
  — sm50..sm121, fp16/fp32 (+bf16 from sm80), head dims divisible by ``minimum_gemm_alignment``,
  storage offsets aligned on sm80+, equal heads (no GQA); ``can_use_cudnn_attention``; math.
* **cuDNN attention.** The PyPI 2.13.0 wheel (cu130) pins nvidia-cudnn-cu13 9.20.0.48, so
  ``check_prefer_cudnn_attention`` (cuDNN > 9.15.0 on sm9x/sm10x) puts cuDNN first on H100/H200/
  B200. vram does not by default (`PREFER_CUDNN`): cuDNN's workspace comes from its heuristics
  (``MHA.cpp``: ``mha_graph->get_workspace_size()``) and cannot be derived from source. When chosen
  (preferred, or forced with ``sdpa_kernel``), its seed/offset, output and logsumexp are charged,
  not its workspace.
* **Allocations** (`op_plan`): ``flash_attn/flash_api.cpp`` ``mha_fwd``/``mha_bwd`` with
  ``cuda/attention_backward.cu`` ``_flash_attention_backward``; ``cuda/attention.cu``
  ``_efficient_attention_forward`` and ``attention_backward.cu`` ``_efficient_attention_backward``
  with the kernel lists of ``mem_eff_attention/kernels/cutlass{F,B}.h``; the math path is
  ``attention.cpp`` ``_scaled_dot_product_attention_math`` replayed op by op (`_math`).

Not modelled: nested tensors (left to PyTorch's composite), FA3, batches > 65535 (chunked), the
shared-memory fit of mem-efficient kernels (``sizeof(SharedStorage) > sharedMemPerBlockOptin``
skips a kernel: sm80/sm90 fit the first kernel by ``kMaxK``; sm75/sm86/sm89 may fall back to one
with other tiles), cuDNN's workspace and internal copies.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)
#: cuDNN runtime version of the simulated build (``versionRuntimeCuDNN``): 9.20.0, torch 2.13.0's pin
CUDNN_VERSION = 92000
#: whether ``check_prefer_cudnn_attention`` may put cuDNN first (off: see the module docstring;
#: equivalent to running with ``TORCH_CUDNN_SDPA_DEPRIORITIZED=1``)
PREFER_CUDNN = False
_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_DEFAULT_ORDER = [1, 2, 0, 3, 4]
#: capability of the device an efficient-attention forward ran on, by its logsumexp storage
_EFFICIENT_CC: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


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


def _qkv(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return p["query"], p["key"], p["value"]


def _requires_grad(p: dict[str, Any]) -> bool:
    """``input_requires_grad``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in _qkv(p))


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()


def _dtype_ok(p: dict[str, Any], allowed: tuple[torch.dtype, ...]) -> bool:
    """``check_tensor_dtype``."""
    q, k, v = _qkv(p)
    return q.dtype == k.dtype == v.dtype and q.dtype in allowed


def _low_precision(p: dict[str, Any], cc: tuple[int, int]) -> bool:
    """``check_dtypes_low_precision``: fp16/bf16 from sm80, fp16 below."""
    return _dtype_ok(p, _HALF if cc[0] >= 8 else (torch.float16,))


def _heads_ok(p: dict[str, Any], supports_gqa: bool, requires_same_num_heads: bool = True) -> bool:
    """``check_batch_size_and_num_heads_dense`` (+ ``check_grouped_query_attention``)."""
    q, k, v = _qkv(p)
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
    q, k, v = _qkv(p)
    ok = all(t.stride(-1) == 1 for t in (q, k, v)) or (ignore_singleton and q.size(-1) == 1)
    mask = p["attn_mask"]
    return ok and (mask is None or mask.stride(-1) == 1)


def _nonzero_seqlens(p: dict[str, Any]) -> bool:
    """``check_nonzero_sequence_lengths_dense``."""
    return p["query"].size(-2) != 0 and p["key"].size(-2) != 0


def _four_dims(p: dict[str, Any]) -> bool:
    """``check_tensor_shapes``."""
    return all(t.dim() == 4 for t in _qkv(p))


def minimum_gemm_alignment(dtype: torch.dtype, major: int) -> int:
    """``minimum_gemm_alignment``: elements the mem-efficient GEMMs need head dims divisible by."""
    half = dtype in _HALF
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
    q, k, v = _qkv(p)
    d = q.size(-1)

    def gt192() -> bool:
        if not (_requires_grad(p) and (_sm(cc, (8, 6), (8, 9)) or _sm(cc, (12, 0), (12, 1)))):
            return True
        return d <= 192 or (not p["dropout_p"] > 0 and d > 224)

    def dtypes() -> bool:  # check_dtypes_flash_attention: FA3 adds fp8 on sm90+ when activated
        fa3 = getattr(torch._C, "_get_fa3_sdp_enabled", lambda: False)()
        if cc[0] >= 9 and fa3:
            return _dtype_ok(p, (torch.float8_e4m3fn, *_HALF))
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
    q, k, v = _qkv(p)
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
    q, k, v = _qkv(p)
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
        ("check_cudnn_deterministic", lambda: not _deterministic()),
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
                    cudnn_version: int | None = None) -> dict[str, str | None]:
    """For each fused backend, the first ``sdp_utils.cpp`` check that refuses `p` (None: usable)."""
    cc, version = (major, minor), CUDNN_VERSION if cudnn_version is None else cudnn_version
    out: dict[str, str | None] = {}
    for name, checks in (("flash", _flash_checks(p, cc)), ("efficient", _efficient_checks(p, cc)),
                         ("cudnn", _cudnn_checks(p, cc, version))):
        out[name] = next((check for check, ok in checks if not ok()), None)
    return out


def select_sdpa_backend(p: dict[str, Any], major: int = 9, minor: int = 0, *,
                        cudnn_version: int | None = None, prefer_cudnn: bool | None = None) -> str:
    """"flash", "efficient", "cudnn" or "math": ``select_sdp_backend`` on a device of this capability."""
    q, k, v = _qkv(p)
    if any(t.is_nested for t in (q, k, v)):
        return "math"  # nested inputs: not modelled, PyTorch's own composite runs
    version = CUDNN_VERSION if cudnn_version is None else cudnn_version
    prefer = PREFER_CUDNN if prefer_cudnn is None else prefer_cudnn
    enabled = {"math": torch.backends.cuda.math_sdp_enabled(), "flash": torch.backends.cuda.flash_sdp_enabled(),
               "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
               "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
    if not any(enabled.values()):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely "
                           "due to turning off both the math kernel and the fused kernels.")
    order = list(torch._C._get_sdp_priority_order())
    # check_prefer_cudnn_attention (a CUDA 13 build): cuDNN > 9.15.0 on sm9x/sm10x
    if prefer and version > 91500 and major in (9, 10) and order == _DEFAULT_ORDER:
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


# -- running it ---------------------------------------------------------------------------------------
def convert_boolean_attn_mask(mask: Any, dtype: torch.dtype) -> Any:
    """``convert_boolean_attn_mask``: ``at::where(mask, 0.0, scalar_tensor(-inf))``."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))
    return mask


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> None:
    """``validate_sdpa_input`` (attention.cpp), PyTorch's messages."""
    if not q.dtype == k.dtype == v.dtype:
        raise RuntimeError("Expected query, key, and value to have the same dtype, but got query.dtype: "
                           f"{q.dtype} key.dtype: {k.dtype} and value.dtype: {v.dtype} instead.")
    if min(q.dim(), k.dim(), v.dim()) < 2:
        raise RuntimeError("Expected query, key, and value to all be  at least 2 dimensional, but got "
                           f"query.dim: {q.dim()} key.dim: {k.dim()} and value.dim: {v.dim()} instead.")
    if isinstance(mask, torch.Tensor) and mask.dtype not in (torch.bool, torch.float32, q.dtype):
        raise RuntimeError("Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                           f"attn_mask.dtype: {mask.dtype} and  query.dtype: {q.dtype} instead.")


def _dropout(t: torch.Tensor, p: float) -> torch.Tensor:
    """``at::dropout(t, p, true)`` on a GPU: the fused ``native_dropout`` (``is_fused_kernel_acceptable``)."""
    if 0 < p < 1 and t.numel() > 0:
        return torch.native_dropout(t, p, True)[0]
    return torch.dropout(t, p, True)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout_p: float, is_causal: bool,
          scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` op by op, as the CUDA build runs it: ``add_`` in place
    (``areAnyTensorSubclassLike`` is true under vram's modes, which would make it out of place)."""
    origin = q.dtype
    upcast = not torch._C._get_math_sdp_allow_fp16_bf16_reduction()
    q_acc, k_acc, v_acc = (t.to(torch.float32) if upcast and t.dtype in _HALF else t for t in (q, k, v))
    negative = scale is not None and scale < 0
    factor = math.sqrt(abs(scale) if negative else (scale if scale is not None else 1.0 / math.sqrt(q_acc.size(-1))))
    query = q_acc * (-factor if negative else factor)
    if is_causal:
        if mask is not None:
            raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when "
                               "is_causal=True")
        mask = convert_boolean_attn_mask(
            torch.ones(query.size(-2), k_acc.size(-2), dtype=torch.bool, device=query.device).tril(), query.dtype)
    key, value = k_acc, v_acc  # pre_process_group_query_attention_input
    if enable_gqa and not query.size(-3) == key.size(-3) == value.size(-3):
        if query.size(-3) % key.size(-3) or query.size(-3) % value.size(-3):
            raise RuntimeError("Number of heads in key and value must divide the number of heads in ")
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    attn = torch.matmul(query, key.transpose(-2, -1) * factor)
    if mask is not None:
        attn.add_(mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = _dropout(attn, dropout_p)
    # make_tuple(matmul(attn, v).to(origin), attn.to(origin)): arguments evaluated right to left
    weights = attn.to(origin)  # noqa: F841  (dies with the tuple, after the output)
    return torch.matmul(attn, value).to(origin)


def _pad_last_dim(t: torch.Tensor, align: int) -> torch.Tensor:
    """``pad_last_dim<false>``."""
    last = t.size(-1)
    return t if last % align == 0 else F.pad(t, (0, align - last % align))


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``preprocess_mask``: pad (``pad_bias<8>``) unless ``aligned_tensor<8>``, then expand to 4-D."""
    aligned = all(mask.stride(i) % 8 == 0 for i in range(mask.dim() - 1)) and mask.stride(-1) == 1
    if not aligned:
        last = mask.size(-1)
        mask = F.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))


def sdpa_cuda(p: dict[str, Any], backend: str, fallback: Any, major: int = 9, minor: int = 0) -> torch.Tensor:
    """``scaled_dot_product_attention`` (attention.cpp) the way the CUDA build runs `backend`, on meta."""
    q, k, v = _qkv(p)
    mask, scale, drop, causal = p["attn_mask"], p["scale"], p["dropout_p"], p["is_causal"]
    _validate(q, k, v, mask)
    if 0 in (q.numel(), k.numel(), v.numel()) or any(t.is_nested for t in (q, k, v)):
        return fallback(q, k, v, attn_mask=mask, dropout_p=drop, is_causal=causal, scale=scale,
                        enable_gqa=p["enable_gqa"])  # the composite's zero-size path, or nested
    mask = convert_boolean_attn_mask(mask, q.dtype)
    if backend == "math":
        return _math(q, k, v, mask, drop, causal, scale, p["enable_gqa"])
    grad = _requires_grad(p)  # should_compute_logsumexp
    if backend == "flash":
        d = q.size(-1)
        og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
        qp, kp, vp = (_pad_last_dim(t, 8) for t in (q, k, v))
        out = torch.ops.aten._scaled_dot_product_flash_attention(qp, kp, vp, drop, causal, False,
                                                                  scale=og_scale)[0]
        return out[..., :d] if out.size(-1) != d else out
    if backend == "cudnn":
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, mask, grad, drop, causal, False,
                                                                  scale=scale)[0]
    if isinstance(mask, torch.Tensor):
        mask = _preprocess_mask(mask, q, k)
    res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, grad, drop, causal, scale=scale)
    _EFFICIENT_CC[res[1].untyped_storage()] = (major, minor)
    return res[0]


# -- what the kernels allocate ------------------------------------------------------------------------
def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_if_strided(t: Any) -> int:
    """Bytes of ``t.transpose(1, 2).contiguous()`` (0 when already contiguous)."""
    if not isinstance(t, torch.Tensor) or t.transpose(1, 2).is_contiguous():
        return 0
    return _nbytes(t)


def num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """``num_splits_heuristic`` (flash_api.cpp)."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or -(-num_n_blocks // s) != -(-num_n_blocks // (s - 1))

    eff = []
    for s in range(1, max_splits + 1):
        waves = batch_nheads_mblocks * s / num_sms
        eff.append(waves / math.ceil(waves) if eligible(s) else 0.0)
    best = max(eff, default=0.0)
    return next((s for s in range(1, max_splits + 1) if eligible(s) and eff[s - 1] >= 0.85 * best), 1)


def _flash_forward(args: tuple[Any, ...], sms: int) -> list[tuple[str, Any]]:
    """``mha_fwd``: out, softmax_lse, split-KV accumulators, rng_state, _unused."""
    q, k = args[0], args[1]
    dropout = float(args[3]) if len(args) > 3 else 0.0
    b, h, sq, d = q.shape
    hk, sk = k.size(1), k.size(2)
    if sq == 1 and h > hk and dropout == 0.0 and d % 8 == 0:  # seqlenq_ngroups_swapped
        h, sq = hk, h // hk
    dr = _round(d, 32 if d <= 128 else 64)
    block_n = 256 if d <= 64 else (128 if d <= 128 else 64)
    splits = 1
    if dropout == 0.0:
        splits = num_splits_heuristic(b * h * -(-sq // 64), sms * 2, -(-sk // block_n), 128)
    plan: list[tuple[str, Any]] = [("out", 0), ("out", 1)]
    tmps = 0
    if splits > 1:  # set_params_splitkv
        plan += [("tmp", splits * b * h * sq * 4), ("tmp", splits * b * h * sq * dr * 4)]
        tmps = 2
    if dropout > 0.0:  # the first rng_state is replaced once the generator is locked
        plan += [("tmp", 16), ("out", 7), ("out", 6), ("free", tmps)]
    else:
        plan += [("out", 6), ("out", 7)]
    return plan + ([("free", 0), ("free", 1)] if splits > 1 else [])


def _flash_backward(args: tuple[Any, ...], sms: int) -> list[tuple[str, Any]]:
    """``_flash_attention_backward`` + ``mha_bwd``: contiguous dout/out, dq/dk/dv, softmax_d, dq_accum,
    dk/dv expanded to all heads for GQA (summed into dk/dv)."""
    q, k = args[1], args[2]
    b, h, sq, d = q.shape
    hk, sk = k.size(1), k.size(2)
    plan: list[tuple[str, Any]] = []
    for t in (args[0], args[4]):  # contiguous_grad_out, contiguous_out (BSHD)
        if _copy_if_strided(t):
            plan.append(("tmp", _copy_if_strided(t)))
    copies = len(plan)
    sq128, dr = _round(sq, 128), _round(d, 32 if d <= 128 else 64)
    nsplits = -(-sms // (b * h)) if _deterministic() else 1
    plan += [("out", 0), ("out", 1), ("out", 2), ("tmp", b * h * sq128 * 4), ("tmp", nsplits * b * sq128 * h * dr * 4)]
    if hk != h:
        plan += [("tmp", b * sk * h * d * q.element_size())] * 2 + [("free", copies + 3), ("free", copies + 2)]
    plan += [("free", copies + 1), ("free", copies)]
    return plan + [("free", i) for i in reversed(range(copies))]


# AttentionBackwardKernel lists of cutlassB.h, first fit by kMaxK (aligned, not seq-aligned twins
# share their tiles): (dropout, preload, kBlockSizeI, kBlockSizeJ, kMaxK, only on these cc)
_SM80_HALF = ((False, True, 64, 64, 32, ()), (False, True, 64, 64, 64, ()), (False, True, 128, 64, 96, (86, 89)),
              (False, True, 128, 128, 128, ()), (False, False, 64, 64, 128, ()),
              (False, False, 128, 64, 65536, ()), (False, False, 64, 64, 65536, ()),
              (True, True, 64, 64, 32, ()), (True, True, 64, 64, 64, ()), (True, True, 128, 128, 128, ()),
              (True, False, 64, 64, 128, ()), (True, False, 128, 64, 65536, ()), (True, False, 64, 64, 65536, ()))
_TILES_128 = ((64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 128), (128, 64, 65536), (64, 64, 65536))
_TILES_64 = ((64, 64, 32), (64, 64, 64), (64, 64, 128), (64, 64, 65536))


def _cutlass_b(dtype: torch.dtype, cc: int, max_k: int, dropout: bool) -> tuple[int, int, int, int]:
    """The backward kernel ``dispatch_cutlassB`` launches: (min sm, kBlockSizeI, kBlockSizeJ, kMaxK)."""
    half = dtype in _HALF
    if cc >= 80:
        arch = 80
        kernels = _SM80_HALF if half else tuple((dr, False, *t, ()) for dr in (False, True) for t in _TILES_128)
    else:
        arch = 75 if cc >= 75 else (70 if cc >= 70 else 50)
        tiles = _TILES_128 if (arch == 75 and half) or (arch == 70 and half) else _TILES_64
        kernels = tuple((dr, False, *t, ()) for dr in (False, True) for t in tiles)
    for drop, _, bi, bj, kmax, only in kernels:
        if kmax >= max_k and (drop or not dropout) and (not only or cc in only):
            return arch, bi, bj, kmax
    return arch, 64, 64, 65536


def _efficient_backward(args: tuple[Any, ...]) -> list[tuple[str, Any]]:
    """``_efficient_attention_backward``: contiguous grad_out, grads, delta, the float32 workspace."""
    g, q, k, v, lse = args[0], args[1], args[2], args[3], args[6]
    dropout = float(args[9]) > 0 if len(args) > 9 else False
    b, h, m, d = q.shape
    n, dv = k.size(2), v.size(3)
    major, minor = _EFFICIENT_CC.get(lse.untyped_storage(), (9, 0))
    arch, bi, bj, kmax = _cutlass_b(q.dtype, major * 10 + minor, max(d, dv), dropout)
    half = q.dtype in _HALF
    in_rf = half and kmax <= bi
    split_keys = arch >= 70
    acc_q, acc_kv = split_keys or half, not in_rf and half
    plan: list[tuple[str, Any]] = [("tmp", _copy_if_strided(g))] if _copy_if_strided(g) else []
    base = len(plan)
    plan += [("out", 0), ("out", 1), ("out", 2), ("out", 3)]
    if half and (in_rf or arch != 70):  # kKernelComputesDelta
        plan += [("tmp", b * h * m * 4)]
        delta = base
    else:  # (grad_out.to(float) * out.to(float)).sum(-1).transpose(-2, -1).contiguous()
        chain = [("tmp", b * m * h * dv * 4)] * (2 if half else 0)  # the float copies (out's first)
        plan += chain + [("tmp", b * m * h * dv * 4), ("tmp", b * m * h * 4), ("tmp", b * h * m * 4)]
        first = base + len(chain)
        plan += [("free", first + 1), ("free", first)] + [("free", i) for i in reversed(range(base, first))]
        delta = first + 2
    splits = -(-n // bj)
    if b * h >= 256 and n <= 2 * bj:
        splits = 1
    if acc_kv:
        splits = min(splits, 200 // (b * h))
    if not split_keys or splits < 1 or _deterministic():
        splits = 1
    gk = splits * bj * _round(d, bi) if acc_kv else 0
    gv = splits * bj * _round(dv, bi) if acc_kv else 0
    gq = -(-m // bi) * -(-d // bj) * (4 + bi * bj) if acc_q else 0
    workspace = b * h * _round(gk + gv + gq, 4) * 4
    plan += [("tmp", workspace)] if workspace else []
    plan += [("free", delta)] + ([("free", delta + 1)] if workspace else [])
    return plan + ([("free", 0)] if base else [])


def op_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int) -> list[tuple[str, Any]] | None:
    """The allocation order of an SDPA kernel (see `vram.run.kernels.plan.op_plan`), None for other ops."""
    if name == "_scaled_dot_product_flash_attention":
        return _flash_forward(args, sms)
    if name == "_scaled_dot_product_flash_attention_backward":
        return _flash_backward(args, sms)
    if name == "_scaled_dot_product_efficient_attention":
        q, k, v = args[0], args[1], args[2]
        plan: list[tuple[str, Any]] = [("out", 0), ("out", 1)]  # philox seed/offset: CPU tensors
        if q.dtype in _HALF and max(k.size(-1), v.size(-1)) > 128:  # kNeedsOutputAccumulatorBuffer
            plan += [("tmp", q.size(0) * q.size(2) * q.size(1) * v.size(-1) * 4), ("free", 0)]
        return plan
    if name == "_scaled_dot_product_efficient_attention_backward":
        return _efficient_backward(args)
    if name == "_scaled_dot_product_cudnn_attention":  # seed, offset, o, softmaxstats (workspace: unknown)
        return [("out", 6), ("out", 7), ("out", 0)] + ([("out", 1)] if len(args) > 4 and args[4] else [])
    if name == "_safe_softmax":  # softmax, isneginf, all(keepdim), scalar 0: where_out into softmax
        x = args[0]
        rows = x.numel() // max(x.size(args[1]), 1) if x.dim() else x.numel()
        return [("out", 0), ("tmp", x.numel()), ("tmp", rows), ("tmp", outs[0].element_size()),
                ("free", 2), ("free", 1), ("free", 0)]
    return None
