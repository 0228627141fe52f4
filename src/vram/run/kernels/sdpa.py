"""What ``scaled_dot_product_attention``'s CUDA kernels allocate, forward and backward, once
`vram.run.kernels.sdpa_choice` has picked the kernel (paths under
``aten/src/ATen/native/transformers/``).

* **Allocations** (`op_plan`): ``flash_attn/flash_api.cpp`` ``mha_fwd``/``mha_bwd`` with
  ``cuda/attention_backward.cu`` ``_flash_attention_backward``; ``cuda/attention.cu``
  ``_efficient_attention_forward`` and ``attention_backward.cu`` ``_efficient_attention_backward``
  with the kernel lists of ``mem_eff_attention/kernels/cutlass{F,B}.h``; the math path is
  ``attention.cpp`` ``_scaled_dot_product_attention_math`` replayed op by op (`_math`).
* **cuDNN attention** (preferred on sm90/sm100, or forced with ``sdpa_kernel``): its seed/offset,
  output, logsumexp and workspace, in `vram.run.kernels.sdpa_cudnn`.

Jagged nested tensors: `vram.run.kernels.sdpa_jagged`. Not modelled: FA3, batches > 65535 (chunked), the
shared-memory fit of mem-efficient kernels (``sizeof(SharedStorage) > sharedMemPerBlockOptin``
skips a kernel: sm80/sm90 fit the first kernel by ``kMaxK``; sm75/sm86/sm89 may fall back to one
with other tiles).
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F

from .sdpa_choice import HALF, deterministic_algorithms, qkv, requires_grad
from .sdpa_cudnn import cudnn_backward_plan, cudnn_forward_plan
from .sdpa_jagged import varlen_plan

#: capability of the device an efficient-attention forward ran on, by its logsumexp storage
_EFFICIENT_CC: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


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
    q_acc, k_acc, v_acc = (t.to(torch.float32) if upcast and t.dtype in HALF else t for t in (q, k, v))
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
    weights = attn.to(origin)  # noqa: F841  (dies with the tuple, after the function's locals)
    out = torch.matmul(attn, value).to(origin)
    # the C++ locals die in reverse order of declaration: attn, value_expanded, key_expanded, query,
    # attn_mask, value_acc, key_acc, query_acc (the GPU's recording frees them in this order)
    del attn, value, key, query
    mask = None
    del v_acc, k_acc, q_acc
    return out


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
    q, k, v = qkv(p)
    mask, scale, drop, causal = p["attn_mask"], p["scale"], p["dropout_p"], p["is_causal"]
    _validate(q, k, v, mask)
    if 0 in (q.numel(), k.numel(), v.numel()) or any(t.is_nested for t in (q, k, v)):
        return fallback(q, k, v, attn_mask=mask, dropout_p=drop, is_causal=causal, scale=scale,
                        enable_gqa=p["enable_gqa"])  # the composite's zero-size path, or nested
    mask = convert_boolean_attn_mask(mask, q.dtype)
    if backend == "math":
        return _math(q, k, v, mask, drop, causal, scale, p["enable_gqa"])
    grad = requires_grad(p)  # should_compute_logsumexp
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
    nsplits = -(-sms // (b * h)) if deterministic_algorithms() else 1
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
    half = dtype in HALF
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
    """``_scaled_dot_product_efficient_attention_backward`` (BHMK inputs, transposed to BMHK)."""
    g, q, k, v, lse = args[0], args[1], args[2], args[3], args[6]
    dropout = float(args[9]) > 0 if len(args) > 9 else False
    b, h, m, d = q.shape
    major, minor = _EFFICIENT_CC.get(lse.untyped_storage(), (9, 0))
    return _efficient_backward_plan(q.dtype, (b, h, m, k.size(2), d, v.size(3)), (b, m), dropout, (major, minor),
                                    _copy_if_strided(g), 4)


def _efficient_varlen_backward(args: tuple[Any, ...], cc: tuple[int, int]) -> list[tuple[str, Any]]:
    """``_efficient_attention_backward`` called directly (BMHK inputs; jagged nested tensors pass
    ``cu_seqlens``): ``p.num_batches`` is ``cu_seqlens_q.size(0) - 1``, ``p.num_queries`` /
    ``p.num_keys`` the max sequence lengths, the delta ``[B, nH, M]`` over the packed tokens; no
    ``grad_bias`` unless ``bias_requires_grad``."""
    g, q, k, v, cu_q, lse = args[0], args[1], args[2], args[3], args[6], args[10]
    dropout = float(args[11]) > 0
    if len(args) > 19 and args[19]:
        raise NotImplementedError("vram run: _efficient_attention_backward with shared_storage_dqdkdv=True is not "
                                  "modelled")
    b, m, h, d = q.shape
    batches = b if cu_q is None else cu_q.numel() - 1
    max_q, max_k = (m, k.size(1)) if cu_q is None else (int(args[8]), int(args[9]))
    copy = 0 if g.is_contiguous() else g.numel() * g.element_size()
    grads = 4 if len(args) > 15 and args[15] else 3
    return _efficient_backward_plan(q.dtype, (batches, h, max_q, max_k, d, v.size(3)), (b, m), dropout,
                                    _EFFICIENT_CC.get(lse.untyped_storage(), cc), copy, grads)


def _efficient_backward_plan(dtype: torch.dtype, dims: tuple[int, ...], rows: tuple[int, int], dropout: bool,
                             cc: tuple[int, int], copy: int, grads: int) -> list[tuple[str, Any]]:
    """``_efficient_attention_backward``: contiguous grad_out, grads, delta, the float32 workspace.
    `dims`: (batches, heads, queries, keys, head dim, value head dim) as the kernel's params see
    them; `rows`: (B, M) of the tensors (the delta and its float inputs)."""
    b, h, m, n, d, dv = dims
    rb, rm = rows
    arch, bi, bj, kmax = _cutlass_b(dtype, cc[0] * 10 + cc[1], max(d, dv), dropout)
    half = dtype in HALF
    in_rf = half and kmax <= bi
    split_keys = arch >= 70
    acc_q, acc_kv = split_keys or half, not in_rf and half
    plan: list[tuple[str, Any]] = [("tmp", copy)] if copy else []
    base = len(plan)
    plan += [("out", i) for i in range(grads)]
    if half and (in_rf or arch != 70):  # kKernelComputesDelta
        plan += [("tmp", rb * h * rm * 4)]
        delta = base
    else:  # (grad_out.to(float) * out.to(float)).sum(-1).transpose(-2, -1).contiguous()
        chain = [("tmp", rb * rm * h * dv * 4)] * (2 if half else 0)  # the float copies (out's first)
        plan += chain + [("tmp", rb * rm * h * dv * 4), ("tmp", rb * rm * h * 4), ("tmp", rb * h * rm * 4)]
        first = base + len(chain)
        plan += [("free", first + 1), ("free", first)] + [("free", i) for i in reversed(range(base, first))]
        delta = first + 2
    splits = -(-n // bj)
    if b * h >= 256 and n <= 2 * bj:
        splits = 1
    if acc_kv:
        splits = min(splits, 200 // (b * h))
    if not split_keys or splits < 1 or deterministic_algorithms():
        splits = 1
    gk = splits * bj * _round(d, bi) if acc_kv else 0
    gv = splits * bj * _round(dv, bi) if acc_kv else 0
    gq = -(-m // bi) * -(-d // bj) * (4 + bi * bj) if acc_q else 0
    workspace = b * h * _round(gk + gv + gq, 4) * 4
    plan += [("tmp", workspace)] if workspace else []
    plan += [("free", delta)] + ([("free", delta + 1)] if workspace else [])
    return plan + ([("free", 0)] if base else [])


def op_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int,
            cc: tuple[int, int] = (9, 0)) -> list[tuple[str, Any]] | None:
    """The allocation order of an SDPA kernel (see `vram.run.kernels.plan.op_plan`), None for other ops."""
    if name == "_scaled_dot_product_flash_attention":
        return _flash_forward(args, sms)
    if name == "_scaled_dot_product_flash_attention_backward":
        return _flash_backward(args, sms)
    if name == "_scaled_dot_product_efficient_attention":
        q, k, v = args[0], args[1], args[2]
        plan: list[tuple[str, Any]] = [("out", 0), ("out", 1)]  # philox seed/offset: CPU tensors
        if q.dtype in HALF and max(k.size(-1), v.size(-1)) > 128:  # kNeedsOutputAccumulatorBuffer
            plan += [("tmp", q.size(0) * q.size(2) * q.size(1) * v.size(-1) * 4), ("free", 0)]
        return plan
    if name == "_scaled_dot_product_efficient_attention_backward":
        return _efficient_backward(args)
    if name == "_efficient_attention_backward":
        return _efficient_varlen_backward(args, cc)
    if name == "_scaled_dot_product_cudnn_attention":
        return cudnn_forward_plan(args, cc)
    if name == "_scaled_dot_product_cudnn_attention_backward":
        return cudnn_backward_plan(args, cc)
    varlen = varlen_plan(name, args, sms)
    if varlen is not None:
        return varlen
    if name == "_safe_softmax":  # softmax, isneginf, all(keepdim), scalar 0: where_out into softmax
        x = args[0]
        rows = x.numel() // max(x.size(args[1]), 1) if x.dim() else x.numel()
        return [("out", 0), ("tmp", x.numel()), ("tmp", rows), ("tmp", outs[0].element_size()),
                ("free", 2), ("free", 1), ("free", 0)]
    return None
