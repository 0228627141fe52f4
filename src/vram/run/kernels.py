"""What CUDA kernels allocate beyond their outputs, for `vram.run.runtime` (layer 4; needs torch).

A simulated run executes every op on the ``meta`` device and charges the op's *outputs* to the
simulated caching allocator. This module holds the CUDA-specific knowledge on top of that, each
rule taken from PyTorch's CUDA sources (paths relative to ``aten/src/ATen``):

* **cuBLAS workspaces** (``cuda/CublasHandlePool.cpp``). The first cuBLAS call of a (handle,
  stream) pair allocates ``getChosenWorkspaceSize()`` bytes through the caching allocator and
  keeps them for the life of the process (``torch.cuda.empty_cache()`` does not release them).
  Default: 32 MiB (``4096 * 8 * 1024``) on sm90, else ``:4096:2:16:8`` = 8,519,680 bytes;
  ``CUBLAS_WORKSPACE_CONFIG=:SIZE:COUNT[...]`` overrides (sum of SIZE KiB × COUNT). Handles are
  per thread, and the autograd engine runs CUDA backward ops on its own device thread, so the
  first matmul of the first backward pass allocates a *second* workspace — visible in real
  recordings (``shared/traces/cs336-s-mem.pickle``: two 8,519,680-byte ``getNewWorkspace``
  allocations, one in forward, one in backward). The addmm cuBLASLt path (a 1-D contiguous bias,
  beta == 1, 2-D contiguous result, all matrix dims > 1, float/half/bfloat16/double:
  ``native/cuda/Blas.cpp`` ``isInputCompliesAddmmCudaLt``) also allocates the cuBLASLt workspace
  (``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1024, capped at the cuBLAS workspace) unless
  ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes it share the cuBLAS one. Allocation order within
  the op: outputs, cuBLAS workspace, cuBLASLt workspace (``preallocate_cublas_workspaces``'s order).
* **scaled_dot_product_attention** backend choice (``native/transformers/cuda/sdp_utils.cpp``,
  simplified): flash if enabled, 4-D, no mask, equal head dims ≤ 256, float16/bfloat16, not a
  causal non-square problem, heads compatible (GQA needs ``enable_gqa``); else memory-efficient if
  enabled, 4-D, head dims divisible by 8 (half) / 4 (float), float16/bfloat16/float32; else math.
  The math path is what CPU/meta runs anyway; flash/efficient go to their aten ops, whose meta
  kernels return the CUDA kernels' outputs: output + logsumexp (float32 [B, H, S], padded to 32
  for efficient), never the B·H·S² probabilities. A boolean mask is first converted to a float
  additive mask as ``convert_boolean_attn_mask`` does; a head dim not a multiple of 8 is padded for
  flash as ``pad_last_dim<8>`` does. cuDNN attention (preferred on sm90/sm100 by builds with
  cuDNN > 9.15) is not modelled; its saved tensors have the same sizes.
* **flash-attention scratch** (``native/transformers/cuda/flash_attn/flash_api.cpp``). Forward
  (``mha_fwd``): out, softmax_lse, then — when the split-KV heuristic picks more than one split
  (no dropout) — softmax_lse_accum [splits, B, H, Sq] and out_accum [splits, B, H, Sq, Dr] float32,
  then rng_state (uint64[2]) and an unused uint64 scalar; the accumulators are freed when the op
  returns. Backward (``mha_bwd``): dq, dk, dv, softmax_d [B, H, Sq128] float32, dq_accum
  [B, Sq128, H, Dr] float32 (+ dk/dv expanded to all heads for GQA), all scratch freed at the end.
  The memory-efficient kernel's philox seed/offset are CPU tensors without dropout (not charged);
  its optional float32 output accumulator and its backward workspace are not modelled.

The rules follow the newest PyTorch sources read (2026); older releases differ in places (before
the shared cuBLASLt workspace, each Lt matmul allocated and freed its own 1 MiB).

Not modelled (documented limitations) — mostly transient scratch that raises a peak without
changing steady state: cuDNN convolution workspaces; the small staging buffers of multi-block
reductions; the contiguous copies cuBLAS calls make of operands with unsupported strides (e.g. the
expanded gradient of ``sum()``); sort buffers of embedding backward; ``_foreach_norm``
intermediates; NCCL buffers; CUDA graphs.
"""
from __future__ import annotations

import math
import os
import re
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

# -- cuBLAS ---------------------------------------------------------------------------------------
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
                        "_addmm_activation"})
_TRUE = frozenset({"1", "ON", "YES", "TRUE", "Y"})
_FALSE = frozenset({"0", "OFF", "NO", "FALSE", "N"})


def cublas_workspace_size(major: int, minor: int) -> int:
    """``getChosenWorkspaceSize()``: bytes of one cuBLAS workspace on a device of this capability."""
    default = 4096 * 8 * 1024 if (major, minor) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config is None:
        return default
    total, found = 0, False
    for size, count in re.findall(r":([0-9]+):([0-9]+)", config):
        total += int(size) * 1024 * int(count)
        found = True
    return total if found else default


def cublaslt_workspace_size(cublas_size: int) -> int | None:
    """Bytes of the separate cuBLASLt workspace, or None when it shares the cuBLAS one."""
    unified = os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE")
    if unified is not None and unified.upper() in _TRUE:
        return None
    try:
        size = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        size = 1024 * 1024
    if unified is None or unified.upper() not in _FALSE:
        size = min(size, cublas_size)  # getCUDABlasLtWorkspaceSize caps it unless explicitly off
    return size


def uses_cublaslt(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> bool:
    """Whether this addmm takes the cuBLASLt ``gemm_and_bias`` path (``isInputCompliesAddmmCudaLt``)."""
    if name not in ("addmm", "_addmm_activation") or len(args) < 3 or not isinstance(out, torch.Tensor):
        return False
    bias, mat1, mat2 = args[0], args[1], args[2]
    beta = kwargs.get("beta", args[3] if len(args) > 3 else 1)
    return (beta == 1 and bias.dim() == 1 and bias.is_contiguous() and bias.size(0) == mat2.size(1)
            and out.dim() == 2 and out.is_contiguous()
            and mat1.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
            and min(mat1.size(0), mat1.size(1), mat2.size(0), mat2.size(1)) > 1)


# -- scaled_dot_product_attention ------------------------------------------------------------------
def sdpa_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``scaled_dot_product_attention``'s arguments by name, defaults filled in."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                                "scale": None, "enable_gqa": False}
    p = dict(defaults)
    p.update(zip(names, args))
    p.update(kwargs)
    return p


def _heads_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> bool:
    if q.size(0) != k.size(0) or q.size(0) != v.size(0) or k.size(1) != v.size(1):
        return False
    if q.size(1) == k.size(1):
        return True
    return gqa and q.size(1) % k.size(1) == 0


def select_sdpa_backend(p: dict[str, Any]) -> str:
    """"flash", "efficient" or "math": the backend CUDA's ``select_sdp_backend`` would pick."""
    q, k, v = p["query"], p["key"], p["value"]
    dense4 = all(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_nested for t in (q, k, v))
    if not dense4 or 0 in (q.size(2), k.size(2)):
        return "math"
    dq, dk, dv = q.size(-1), k.size(-1), v.size(-1)
    low = q.dtype in (torch.float16, torch.bfloat16)
    same_dtype = q.dtype == k.dtype == v.dtype
    heads = _heads_ok(q, k, v, bool(p["enable_gqa"]))
    if (torch.backends.cuda.flash_sdp_enabled() and p["attn_mask"] is None and low and same_dtype
            and dq == dk == dv and dq <= 256 and heads
            and not (p["is_causal"] and q.size(2) != k.size(2))
            and all(t.stride(-1) == 1 or t.size(-1) == 1 for t in (q, k, v))):
        return "flash"
    align = 8 if low else 4
    if (torch.backends.cuda.mem_efficient_sdp_enabled() and same_dtype and heads
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and dq == dk and dq % align == 0 and dv % align == 0 and dq > 0 and dv > 0
            and all(t.stride(-1) == 1 for t in (q, k, v))):
        return "efficient"
    return "math"


def convert_boolean_attn_mask(mask: Any, dtype: torch.dtype) -> Any:
    """``convert_boolean_attn_mask``: a bool mask becomes a float additive mask (new memory)."""
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
        return torch.where(mask.logical_not(), -math.inf, zero)
    return mask


def sdpa_cuda(p: dict[str, Any], backend: str, fallback: Any) -> torch.Tensor:
    """Run ``scaled_dot_product_attention`` the way CUDA's chosen `backend` would (on meta)."""
    q, k, v = p["query"], p["key"], p["value"]
    mask = convert_boolean_attn_mask(p["attn_mask"], q.dtype)
    if backend == "math":
        return fallback(q, k, v, attn_mask=mask, dropout_p=p["dropout_p"], is_causal=p["is_causal"],
                        scale=p["scale"], enable_gqa=p["enable_gqa"])
    scale = p["scale"]
    if backend == "flash":
        d = q.size(-1)
        if d % 8:  # pad_last_dim<8>: padded copies, scale from the original head dim
            pad = 8 - d % 8
            q, k, v = (torch.nn.functional.pad(t, (0, pad)) for t in (q, k, v))
            scale = scale if scale is not None else 1.0 / math.sqrt(d)
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, p["dropout_p"], p["is_causal"], False, scale=scale)[0]
        return out[..., :d] if d % 8 else out
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if isinstance(mask, torch.Tensor):
        s = mask.size(-1)
        if s % 16:  # preprocess_mask / pad_bias<16>: an aligned copy, sliced back
            mask = torch.nn.functional.pad(mask, (0, 16 - s % 16))[..., :s]
        mask = mask.expand(q.size(0), q.size(1), q.size(2), k.size(2))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, grad, p["dropout_p"], p["is_causal"], scale=scale)[0]


def _num_splits_heuristic(batch_nheads_mblocks: int, num_sms: int, num_n_blocks: int,
                          max_splits: int) -> int:
    """``num_splits_heuristic`` of flash_api.cpp."""
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eff: list[float] = []

    def eligible(s: int) -> bool:
        return s == 1 or -(-num_n_blocks // s) != -(-num_n_blocks // (s - 1))

    for s in range(1, max_splits + 1):
        if not eligible(s):
            eff.append(0.0)
        else:
            waves = batch_nheads_mblocks * s / num_sms
            eff.append(waves / math.ceil(waves))
    best = max(eff) if eff else 0.0
    for s in range(1, max_splits + 1):
        if eligible(s) and eff[s - 1] >= 0.85 * best:
            return s
    return 1


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def op_plan(name: str, args: tuple[Any, ...], outs: list[Any], sms: int) -> list[tuple[str, Any]]:
    """The order in which a CUDA kernel allocates: ("out", i), ("tmp", nbytes) or ("free", j).

    ``("free", j)`` frees the j-th "tmp" of the plan. Ops without special knowledge allocate their
    outputs in output order.
    """
    if name == "_scaled_dot_product_flash_attention":
        q, k = args[0], args[1]
        dropout = float(args[3]) if len(args) > 3 else 0.0
        plan: list[tuple[str, Any]] = [("out", 0), ("out", 1)]
        b, h, sq, d = q.shape
        sk = k.size(2)
        hd = _round(d, 8)
        dr = _round(hd, 32 if hd <= 128 else 64)
        block_n = 256 if hd <= 64 else (128 if hd <= 128 else 64)
        splits = 1
        if dropout == 0.0 and b > 0:
            splits = _num_splits_heuristic(b * h * -(-sq // 64), sms * 2, -(-sk // block_n), 128)
        if splits > 1:
            plan += [("tmp", splits * b * h * sq * 4), ("tmp", splits * b * h * sq * dr * 4)]
        plan += [("out", 6), ("out", 7)]
        if splits > 1:
            plan += [("free", 1), ("free", 0)]
        return plan
    if name == "_scaled_dot_product_flash_attention_backward":
        q, k = args[1], args[2]
        b, h, sq, d = q.shape
        hk, sk = k.size(1), k.size(2)
        dr = _round(d, 32 if d <= 128 else 64)
        sq128 = _round(sq, 128)
        plan = [("out", 0), ("out", 1), ("out", 2), ("tmp", b * h * sq128 * 4),
                ("tmp", b * sq128 * h * dr * 4)]
        if hk != h:
            plan += [("tmp", b * sk * h * d * q.element_size())] * 2 + [("free", 3), ("free", 2)]
        return plan + [("free", 1), ("free", 0)]
    if name == "_scaled_dot_product_efficient_attention":
        return [("out", 0), ("out", 1)]  # philox seed/offset live on the CPU without dropout
    return [("out", i) for i in range(len(outs))]


# -- autocast ("cuda") ------------------------------------------------------------------------------
#: ops autocast runs in the autocast dtype (``autocast_mode.cpp``'s lower_precision_fp list)
AUTOCAST_LOWER = frozenset({
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm",
    "addmv", "addr", "mv", "einsum", "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention",
    "linalg_vecdot", "linalg_multi_dot", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"})
#: ops autocast runs in float32
AUTOCAST_FP32 = frozenset({
    "layer_norm", "group_norm", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss",
    "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "cosine_similarity",
    "cosine_embedding_loss", "margin_ranking_loss", "soft_margin_loss", "multi_margin_loss",
    "triplet_margin_loss", "poisson_nll_loss", "hinge_embedding_loss", "logsumexp", "exp", "log",
    "log10", "log2", "log1p", "expm1", "rsqrt", "reciprocal", "pow", "acos", "asin", "cosh", "sinh",
    "tan", "erfinv", "softplus", "dist", "cdist", "pdist", "renorm", "__pow__", "__rpow__",
    "nll_loss2d", "multilabel_margin_loss", "frobenius_norm", "nuclear_norm"})
#: ops autocast gives ``dtype=torch.float32`` when no dtype is passed (fp32_set_opt_dtype; and
#: ``norm``'s fp32_append_dtype, which has the same effect: computed and returned in float32)
AUTOCAST_FP32_OPT_DTYPE = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum",
                                     "linalg_vector_norm", "linalg_matrix_norm", "norm"})
#: ops autocast refuses on CUDA tensors, whatever their dtypes: their error (``autocast_mode.cpp``)
AUTOCAST_BANNED = {"binary_cross_entropy": (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast.")}
#: ops autocast runs in the widest floating type among their arguments (promote)
AUTOCAST_PROMOTE = frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler",
                              "grid_sample", "index_put", "index_put_", "tensordot", "scatter_add"})


def autocast_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  eligible: Callable[[torch.Tensor], bool],
                  cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor]) -> tuple[Any, Any]:
    """Apply CUDA autocast's policy for op `name` to its arguments (``autocast_mode.cpp``).

    Lower-precision and float32 ops get their eligible (CUDA, floating, not float64) tensors cast;
    the C++ wrapper's argument pack is evaluated right to left (GCC builds), so casts are made in
    that order. fp32_set_opt_dtype ops get ``dtype=torch.float32`` when none is given.
    """
    if name in AUTOCAST_LOWER:
        to = torch.get_autocast_dtype("cuda")
    elif name in AUTOCAST_FP32:
        to = torch.float32
    elif name in AUTOCAST_PROMOTE:
        floats = [t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and eligible(t)]
        if not floats:
            return args, kwargs
        to = floats[0]
        for d in floats[1:]:
            to = torch.promote_types(to, d)
    else:
        if name in AUTOCAST_FP32_OPT_DTYPE and kwargs.get("dtype") is None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is not None and eligible(first):
                kwargs = dict(kwargs, dtype=torch.float32)
        return args, kwargs

    def one(a: Any) -> Any:
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)([one(x) for x in reversed(a)][::-1])
        return cast(a, to) if isinstance(a, torch.Tensor) else a

    kw = {k: one(v) for k, v in reversed(list(kwargs.items()))}
    new = [one(a) for a in reversed(args)][::-1]
    return tuple(new), {k: kw[k] for k in kwargs}


def simple_cross_entropy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Class-index targets, no label smoothing: ``nll_loss(log_softmax(x, dtype=x.dtype))``."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
             "label_smoothing")
    p = dict(zip(names, args), **kwargs)
    x, t = p.get("input"), p.get("target")
    return (isinstance(x, torch.Tensor) and isinstance(t, torch.Tensor) and x.shape != t.shape
            and not p.get("label_smoothing") and p.get("size_average") is None and p.get("reduce") is None)


def cross_entropy_autocast(args: tuple[Any, ...], kwargs: dict[str, Any],
                           cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor]) -> torch.Tensor:
    """``cross_entropy_loss`` under CUDA autocast: it has no autocast kernel of its own, so its
    decomposition runs through autocast — ``log_softmax(x, dim, x.scalar_type())`` keeps the input
    dtype (an explicit dtype is never overridden) and ``nll_loss`` (fp32 policy) casts those
    log-probabilities to float32: a lower-precision and a float32 copy of the logits' size."""
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction")
    p = dict(zip(names, args), **kwargs)
    x = p["input"]
    logp = torch.log_softmax(x, 0 if x.dim() == 1 else 1, dtype=x.dtype)
    weight = p.get("weight")
    return torch.nn.functional.nll_loss(
        cast(logp, torch.float32), p["target"],
        cast(weight, torch.float32) if isinstance(weight, torch.Tensor) else None,
        ignore_index=p.get("ignore_index", -100), reduction=p.get("reduction", "mean"))


# -- Python-level torch functions ------------------------------------------------------------------
#: Python-level torch functions whose own torch calls must meet the function mode (autocast's casts,
#: SDPA routing): a torch function mode runs with itself popped, so these run as a copy whose entry
#: check (``has_torch_function*``) is False, with the mode pushed again (nn.MultiheadAttention,
#: and so nn.Transformer*Layer in training, go through the first; F.normalize's ``norm`` is float32
#: under autocast)
TRANSPARENT = frozenset({F.multi_head_attention_forward, F.normalize})
_CLONES: dict[Any, Any] = {}


def _never(*args: Any) -> bool:
    return False


def transparent(func: Any) -> Any:
    """`func` (one of `TRANSPARENT`) as a copy that does not hand itself to torch-function modes."""
    clone = _CLONES.get(func)
    if clone is None:
        scope = dict(func.__globals__, has_torch_function=_never, has_torch_function_unary=_never,
                     has_torch_function_variadic=_never)
        clone = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
        clone.__kwdefaults__ = func.__kwdefaults__
        _CLONES[func] = clone
    return clone
