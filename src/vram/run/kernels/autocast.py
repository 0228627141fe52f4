"""CUDA autocast's cast policy (``aten/src/ATen/autocast_mode.cpp``) for the ops a simulated run
casts itself: no kernel casts meta tensors, so the engine's function mode applies these lists
(lower precision, float32, float32 by default dtype, promote, banned) and the cross-entropy rule.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

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
#: float32-list ops that only some torch releases' ``autocast_mode.h`` (``AT_FORALL_FP32``) name: each
#: is cast where the installed torch registers a CUDA autocast kernel for it (`registered_for_cuda`)
AUTOCAST_FP32_SINCE = frozenset({
    "native_layer_norm", "rms_norm", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
    "_upsample_bicubic2d_aa"})
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
#: promote-list ops that only some releases name (``AT_FORALL_PROMOTE``), as `AUTOCAST_FP32_SINCE`
AUTOCAST_PROMOTE_SINCE = frozenset({"vdot"})
_REGISTERED: dict[str, bool] = {}


def registered_for_cuda(name: str) -> bool:
    """Whether the installed torch's CUDA autocast casts ``aten::name``: a CPU build registers the
    AutocastCUDA kernels too (``autocast_mode.cpp``'s ``TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)``)."""
    if name not in _REGISTERED:
        try:
            _REGISTERED[name] = torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCUDA")
        except RuntimeError:   # no such operator in this release
            _REGISTERED[name] = False
    return _REGISTERED[name]


_INTERPOLATE_OPS = {"nearest": "upsample_nearest{}d", "nearest-exact": "_upsample_nearest_exact{}d",
                    "linear": "upsample_linear1d", "bilinear": "upsample_bilinear2d",
                    "trilinear": "upsample_trilinear3d", "bicubic": "upsample_bicubic2d"}


def interpolate_op(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The upsample op ``F.interpolate`` calls for its arguments (torch/nn/functional.py: by mode
    and the input's spatial dims; ``antialias`` picks the ``_aa`` kernels; "area" is adaptive
    average pooling, no upsample op)."""
    names = ("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor", "antialias")
    bound = dict(zip(names, args)) | kwargs
    x, mode = bound.get("input"), bound.get("mode", "nearest")
    if not isinstance(x, torch.Tensor) or mode not in _INTERPOLATE_OPS:
        return None
    op = _INTERPOLATE_OPS[mode].format(x.dim() - 2)
    return f"_{op}_aa" if bound.get("antialias") and mode in ("bilinear", "bicubic") else op


def autocast_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                  eligible: Callable[[torch.Tensor], bool],
                  cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor]) -> tuple[Any, Any]:
    """Apply CUDA autocast's policy for op `name` to its arguments (``autocast_mode.cpp``).

    Lower-precision and float32 ops get their eligible (CUDA, floating, not float64) tensors cast;
    the C++ wrapper's argument pack is evaluated right to left (GCC builds), so casts are made in
    that order; inside a tensor list (``einsum``'s operands) they go left to right.
    fp32_set_opt_dtype ops get ``dtype=torch.float32`` when none is given.
    """
    if name == "interpolate":   # a Python function: the cast is its upsample op's
        name = interpolate_op(args, kwargs) or name
    if name in AUTOCAST_LOWER:
        to = torch.get_autocast_dtype("cuda")
    elif name in AUTOCAST_FP32 or (name in AUTOCAST_FP32_SINCE and registered_for_cuda(name)):
        to = torch.float32
    elif name in AUTOCAST_PROMOTE or (name in AUTOCAST_PROMOTE_SINCE and registered_for_cuda(name)):
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
            # a TensorList is cast element by element, left to right (autocast_mode.h's
            # cached_cast overload for TensorList: a plain for loop)
            return type(a)([one(x) for x in a])
        return cast(a, to) if isinstance(a, torch.Tensor) else a

    kw = {k: one(v) for k, v in reversed(list(kwargs.items()))}
    if name == "einsum" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        # torch.einsum(eq, a, b) passes its operands to aten::einsum as one Tensor[]
        return (args[0], *[one(a) for a in args[1:]]), {k: kw[k] for k in kwargs}
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
