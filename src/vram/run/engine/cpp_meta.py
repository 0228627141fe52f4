"""PyTorch's C++ meta kernels for the aten ops whose Python meta kernels give the same, until a
symbolic size can exist.

torch 2.13 registers a Python meta kernel for 1,337 aten ops, for symbolic shapes
(``torch/_meta_registrations.py`` ``activate_meta``, all through one ``Library("aten", "IMPL",
"Meta")``), over the C++ Meta kernel of 636 of them (``torch._C._dispatch_dump`` shows it "Meta
(inactive)") and the ``CompositeExplicitAutograd`` kernel of others (``mul.Scalar``: the number
wrapped, then ``mul.Tensor``, as on CUDA). The Python kernels
import sympy and ``torch.fx.experimental.symbolic_shapes`` on their first call
(``torch._prims_common.elementwise_dtypes``: half a second of a one-line script's start-up that a
GPU run never spends, its kernels being C++) and take milliseconds a call where C++ takes
microseconds. `activate` makes the C++ kernels of `OPS` the Meta kernels again: it resets that
library, which drops torch's Python kernels, and registers the others again, each the function
torch registered (``OpOverload.py_kernels[Meta]``, set by the same line of ``activate_meta``).
Once ``torch.fx.experimental.symbolic_shapes`` is imported (no symbolic size exists before: its
``ShapeEnv`` makes them, and dynamo and fake tensors import it), `restore` registers torch's Python
kernels of `OPS` again, as torch left them. Nothing is changed where that module is already
imported, or where another library's Meta kernel sits over one of torch's (registering torch's
again would put it back on top).

`OPS`: the ops whose C++ kernel gives the Python kernel's outputs (sizes, strides, dtype, storage
offset and size), the same inputs after an in-place or ``out=`` call, the same warnings and the
same exception type on OpInfo's samples, forward, backward, in place and ``out=``
(tests/test_cpp_meta_kernels.py); and where the two differ on a sample, the C++ kernel gives what
the CPU kernel gives (the structured kernels' meta function, shared with CUDA's:
``TensorIterator``'s strides of an empty ``mul`` output, the broadcast check of an in-place
``atan2_``, where the Python kernels accept a ``self`` smaller than the result). Left out:
``mse_loss`` and ``smooth_l1_loss`` (the C++ kernels' scalar output keeps an input-sized storage),
the strides of ``_linalg_svd``'s Vh and of the linalg ``out=`` overloads, and the ops OpInfo's
samples do not reach.
"""
from __future__ import annotations

import sys
from typing import Any

import torch

from vram.run.cuda.on_import import when_imported

#: where symbolic sizes come from (``ShapeEnv``)
SYMBOLIC = "torch.fx.experimental.symbolic_shapes"
_META = torch._C.DispatchKey.Meta
_ACTIVE: list[tuple[str, Any]] = []  # (op name, torch's Python kernel) of the ops on their C++ kernel

OPS = frozenset({
    "_chunk_cat", "_chunk_cat.out", "_linalg_det", "_linalg_eigh", "_linalg_slogdet", "_linalg_solve_ex",
    "_linalg_solve_ex.result", "_log_softmax", "_log_softmax_backward_data", "_safe_softmax", "_softmax",
    "_softmax_backward_data", "_unsafe_view", "_upsample_bilinear2d_aa", "_upsample_bilinear2d_aa_backward",
    "_upsample_nearest_exact1d", "acos", "acos.out", "acos_", "acosh", "acosh.out", "acosh_",
    "adaptive_max_pool2d", "adaptive_max_pool2d_backward", "adaptive_max_pool3d", "adaptive_max_pool3d_backward",
    "add.Scalar", "add.Tensor", "add.out", "add_.Scalar", "add_.Tensor", "addmm", "addmm.out", "addmm_", "addmv",
    "addmv.out", "addmv_", "addr", "addr.out", "alias_copy", "alias_copy.out", "all", "all.all_out", "all.dim",
    "all.out", "amax", "amax.out", "amin", "amin.out", "aminmax", "aminmax.out", "any", "any.all_out", "any.dim",
    "any.out", "arange", "arange.start", "arange.start_out", "arange.start_step", "argmax", "argmin",
    "as_strided_copy", "as_strided_copy.out", "asin", "asin.out", "asin_", "asinh", "asinh.out", "asinh_",
    "atan", "atan.out", "atan2", "atan2.out", "atan2_", "atan_", "atanh", "atanh.out", "atanh_", "avg_pool2d",
    "avg_pool2d_backward", "avg_pool3d", "avg_pool3d.out", "avg_pool3d_backward", "baddbmm", "baddbmm.out",
    "baddbmm_", "bernoulli", "bernoulli_.float", "bitwise_and.Tensor", "bitwise_and.Tensor_out",
    "bitwise_and_.Tensor", "bitwise_left_shift.Tensor", "bitwise_left_shift.Tensor_out",
    "bitwise_left_shift_.Tensor", "bitwise_not", "bitwise_not.out", "bitwise_not_", "bitwise_or.Tensor",
    "bitwise_or.Tensor_out", "bitwise_or_.Tensor", "bitwise_right_shift.Tensor",
    "bitwise_right_shift.Tensor_out", "bitwise_right_shift_.Tensor", "bitwise_xor.Tensor",
    "bitwise_xor.Tensor_out", "bitwise_xor_.Tensor", "block_diag", "bmm", "bmm.out", "cat", "cat.out", "cauchy_",
    "ceil", "ceil.out", "ceil_", "celu", "celu_", "cholesky_solve", "cholesky_solve.out", "clamp.Tensor",
    "clamp.Tensor_out", "clamp_.Tensor", "clamp_max.Tensor", "clamp_max.Tensor_out", "clamp_max_.Tensor",
    "clamp_min", "clamp_min.Tensor", "clamp_min.Tensor_out", "clamp_min_", "clamp_min_.Tensor", "conj_physical_",
    "convolution", "copysign.Tensor", "copysign.out", "copysign_.Tensor", "cos", "cos.out", "cos_", "cosh",
    "cosh.out", "cosh_", "count_nonzero", "cumprod", "cumprod.out", "cumprod_", "cumsum", "cumsum.out",
    "cumsum_", "deg2rad", "deg2rad.out", "deg2rad_", "diag_embed", "diag_embed.out", "diagonal_backward",
    "diagonal_copy", "diagonal_copy.out", "diagonal_scatter", "digamma", "digamma.out", "digamma_", "dist",
    "div.Scalar", "div.Tensor", "div.out", "div_.Scalar", "div_.Tensor", "elu", "elu_", "elu_backward",
    "empty_like", "eq.Scalar", "eq.Tensor", "eq.Tensor_out", "eq_.Tensor", "erf", "erf.out", "erf_", "erfc",
    "erfc.out", "erfc_", "erfinv", "erfinv.out", "erfinv_", "exp", "exp.out", "exp2", "exp2.out", "exp2_",
    "exp_", "expand_copy", "expand_copy.out", "expm1", "expm1.out", "expm1_", "exponential_", "eye", "eye.m",
    "eye.m_out", "eye.out", "fill.Scalar", "fill_.Scalar", "floor", "floor.out", "floor_", "fmax", "fmax.out",
    "fmin", "fmin.out", "frac", "frac.out", "frac_", "fractional_max_pool2d", "full", "full.out", "gather",
    "gcd", "gcd.out", "gcd_", "ge.Scalar", "ge.Tensor", "ge.Tensor_out", "ge_.Tensor", "gelu", "gelu.out",
    "gelu_backward", "geometric_", "glu", "gt.Scalar", "gt.Tensor", "gt.Tensor_out", "gt_.Tensor", "hardshrink",
    "hardshrink.out", "hardsigmoid", "hardsigmoid_", "hardsigmoid_backward", "heaviside", "heaviside.out",
    "heaviside_", "hypot", "hypot.out", "hypot_", "i0", "i0.out", "i0_", "igamma", "igamma.out", "igamma_",
    "igammac", "igammac.out", "igammac_", "index.Tensor", "index_add", "index_add.out", "index_add_",
    "index_copy", "index_copy.out", "index_copy_", "index_fill.int_Scalar", "index_fill.int_Tensor", "index_put",
    "index_put_", "index_reduce", "index_reduce_", "isin.Tensor_Tensor", "isin.Tensor_Tensor_out", "isneginf",
    "isneginf.out", "isposinf", "isposinf.out", "lcm", "lcm.out", "lcm_", "ldexp.Tensor", "ldexp.out",
    "le.Scalar", "le.Tensor", "le.Tensor_out", "le_.Tensor", "leaky_relu", "leaky_relu_", "leaky_relu_backward",
    "lerp.Scalar", "lerp.Scalar_out", "lerp_.Scalar", "lerp_.Tensor", "lgamma", "lgamma.out", "lgamma_",
    "linalg_cholesky_ex", "linalg_cross", "linalg_cross.out", "linalg_inv_ex", "linalg_ldl_factor_ex",
    "linalg_ldl_solve", "linalg_lu", "linalg_lu.out", "linalg_lu_factor_ex", "linalg_lu_solve", "linalg_qr",
    "linalg_vector_norm", "linalg_vector_norm.out", "linspace", "linspace.out", "log", "log.out", "log10",
    "log10.out", "log10_", "log1p", "log1p.out", "log1p_", "log2", "log2.out", "log2_", "log_", "log_normal_",
    "logaddexp", "logaddexp.out", "logaddexp2", "logaddexp2.out", "logit_", "logit_backward", "logspace",
    "logspace.out", "lt.Scalar", "lt.Tensor", "lt.Tensor_out", "lt_.Tensor", "lu_unpack", "lu_unpack.out",
    "masked_fill.Scalar", "masked_fill.Tensor", "masked_fill_.Scalar", "masked_fill_.Tensor", "masked_scatter",
    "masked_scatter_", "max.dim", "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "maximum",
    "maximum.out", "mean", "mean.dim", "mean.dtype_out", "mean.out", "median.dim", "min.dim", "minimum",
    "minimum.out", "mish", "mish_", "mm", "mm.out", "mul.Scalar", "mul.Tensor", "mul.out", "mul_.Scalar",
    "mul_.Tensor", "mv", "mv.out", "mvlgamma", "nanmedian.dim", "narrow_copy", "ne.Scalar", "ne.Tensor",
    "ne.Tensor_out", "ne_.Tensor", "neg", "neg.out", "neg_", "new_empty", "new_empty_strided", "new_full",
    "new_ones", "new_zeros", "nextafter", "nextafter.out", "nextafter_", "nonzero", "norm.ScalarOpt_dim",
    "normal.Tensor_Tensor", "normal.Tensor_Tensor_out", "normal.Tensor_float", "normal.float_float",
    "normal.float_float_out", "normal_", "ones", "ones.out", "permute_copy", "permute_copy.out", "pixel_shuffle",
    "pixel_unshuffle", "polygamma", "polygamma.out", "pow.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Scalar_out",
    "pow.Tensor_Tensor", "pow.Tensor_Tensor_out", "pow_.Scalar", "pow_.Tensor", "prod.dim_int", "rad2deg",
    "rad2deg.out", "rad2deg_", "rand", "randint", "randint.low", "randn", "reciprocal", "reciprocal.out",
    "reciprocal_", "reflection_pad1d", "reflection_pad1d_backward", "relu_", "remainder.Scalar",
    "remainder.Tensor", "renorm", "renorm.out", "renorm_", "repeat", "replication_pad1d",
    "replication_pad1d_backward", "replication_pad2d", "round", "round.decimals", "round.decimals_out",
    "round.out", "round_", "round_.decimals", "rrelu_with_noise_", "rrelu_with_noise_backward", "rsqrt",
    "rsqrt.out", "rsqrt_", "rsub.Scalar", "scalar_tensor", "scatter.reduce", "scatter.src", "scatter.value",
    "scatter_.reduce", "scatter_.src", "scatter_.value", "scatter_add", "scatter_add_", "scatter_reduce.two",
    "scatter_reduce.two_out", "scatter_reduce_.two", "select_backward", "select_scatter", "sgn", "sgn.out",
    "sgn_", "sigmoid", "sigmoid.out", "sigmoid_", "sigmoid_backward", "sign", "sign.out", "sign_", "signbit",
    "signbit.out", "silu", "silu_", "sin", "sin.out", "sin_", "sinc", "sinc.out", "sinc_", "sinh", "sinh.out",
    "sinh_", "slice_backward", "slice_scatter", "slice_scatter.out", "soft_margin_loss",
    "soft_margin_loss_backward", "softplus", "softplus.out", "softplus_backward", "softshrink", "softshrink.out",
    "sort", "sort.values", "special_airy_ai", "special_airy_ai.out", "special_bessel_j0",
    "special_bessel_j0.out", "special_bessel_j1", "special_bessel_j1.out", "special_bessel_y0",
    "special_bessel_y0.out", "special_bessel_y1", "special_bessel_y1.out", "special_chebyshev_polynomial_t",
    "special_chebyshev_polynomial_t.out", "special_chebyshev_polynomial_u", "special_chebyshev_polynomial_u.out",
    "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_v.out", "special_chebyshev_polynomial_w",
    "special_chebyshev_polynomial_w.out", "special_entr", "special_entr.out", "special_erfcx",
    "special_erfcx.out", "special_hermite_polynomial_h", "special_hermite_polynomial_h.out",
    "special_hermite_polynomial_he", "special_hermite_polynomial_he.out", "special_i0e", "special_i0e.out",
    "special_i1", "special_i1.out", "special_i1e", "special_i1e.out", "special_laguerre_polynomial_l",
    "special_laguerre_polynomial_l.out", "special_legendre_polynomial_p", "special_legendre_polynomial_p.out",
    "special_log_ndtr", "special_log_ndtr.out", "special_modified_bessel_i0", "special_modified_bessel_i0.out",
    "special_modified_bessel_i1", "special_modified_bessel_i1.out", "special_modified_bessel_k0",
    "special_modified_bessel_k0.out", "special_modified_bessel_k1", "special_modified_bessel_k1.out",
    "special_ndtri", "special_ndtri.out", "special_scaled_modified_bessel_k0",
    "special_scaled_modified_bessel_k0.out", "special_scaled_modified_bessel_k1",
    "special_scaled_modified_bessel_k1.out", "special_shifted_chebyshev_polynomial_t",
    "special_shifted_chebyshev_polynomial_t.out", "special_shifted_chebyshev_polynomial_u",
    "special_shifted_chebyshev_polynomial_u.out", "special_shifted_chebyshev_polynomial_v",
    "special_shifted_chebyshev_polynomial_v.out", "special_shifted_chebyshev_polynomial_w",
    "special_shifted_chebyshev_polynomial_w.out", "special_spherical_bessel_j0",
    "special_spherical_bessel_j0.out", "special_xlog1py", "special_xlog1py.out", "special_zeta",
    "special_zeta.out", "split_with_sizes_copy", "split_with_sizes_copy.out", "sqrt", "sqrt.out", "sqrt_",
    "squeeze_copy", "squeeze_copy.dim", "squeeze_copy.dim_out", "squeeze_copy.out", "stack", "stack.out",
    "sub.Scalar", "sub.Tensor", "sub.out", "sub_.Tensor", "sum", "sum.dim_IntList", "t_", "t_copy", "t_copy.out",
    "tan", "tan.out", "tan_", "tanh", "tanh.out", "tanh_", "tanh_backward", "threshold_backward", "topk",
    "transpose_", "transpose_copy.int", "transpose_copy.int_out", "triangular_solve", "tril", "tril.out",
    "tril_", "triu", "triu.out", "triu_", "trunc", "trunc.out", "trunc_", "unbind_copy.int",
    "unbind_copy.int_out", "unfold_copy", "unfold_copy.out", "uniform_", "unsafe_split.Tensor", "unsqueeze_",
    "unsqueeze_copy", "unsqueeze_copy.out", "upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d",
    "upsample_nearest1d", "upsample_trilinear3d", "view_copy", "view_copy.out", "xlogy.OutTensor",
    "xlogy.Tensor", "xlogy_.Tensor", "zero_", "zeros", "zeros.out",
})


def _library() -> Any:
    """torch's library of Python meta kernels, or None where torch has none as 2.13 has it."""
    registrations = sys.modules.get("torch._meta_registrations")
    lib = getattr(registrations, "_meta_lib_dont_use_me_use_register_meta", None)
    if lib is None or getattr(lib, "m", None) is None or not isinstance(getattr(lib, "_op_impls", None), set):
        return None
    return lib


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default", None)


def activate(symbolic: bool = False) -> bool:
    """Put the C++ meta kernels of `OPS` back on top (see the module); True if done. Once per
    process, before a script runs (the library is without Python kernels for a moment).
    `symbolic`: even with `SYMBOLIC` imported, for a caller that calls `restore` (a comparison of
    the kernels on concrete sizes)."""
    lib = _library()
    if _ACTIVE or lib is None or (SYMBOLIC in sys.modules and not symbolic):
        return False
    names = [key.split("/")[1] for key in lib._op_impls if key.startswith("aten/") and key.endswith("/Meta")]
    if len(names) != len(lib._op_impls):
        return False
    python: dict[str, Any] = {}
    ours = f"registered at {sys.modules['torch._meta_registrations'].__file__}:"
    for name in names:
        op = _overload(name)
        fn = getattr(op, "py_kernels", {}).get(_META)
        on_top = torch._C._dispatch_get_computed_kernel_for_dispatch_key(f"aten::{name}", _META)
        if fn is None or ours not in repr(on_top):
            return False
        python[name] = fn
    lib.m.reset()
    cpp = {name for name in names if name in OPS and torch._C._dispatch_has_computed_kernel_for_dispatch_key(
        f"aten::{name}", "Meta")}  # (a C++ kernel under torch's: none is left without a Meta kernel)
    for name in names:
        if name not in cpp:
            lib.m.impl(name, "Meta", python[name], False)
    _ACTIVE.extend((name, python[name]) for name in sorted(cpp))
    if SYMBOLIC not in sys.modules:
        when_imported(SYMBOLIC, lambda module: restore())
    return True


def restore() -> None:
    """Register torch's Python meta kernels of `OPS` again, over the C++ ones."""
    lib = _library()
    if lib is None:
        return
    while _ACTIVE:
        name, fn = _ACTIVE.pop()
        lib.m.impl(name, "Meta", fn, False)


def active() -> bool:
    """Are the C++ meta kernels of `OPS` the Meta kernels?"""
    return bool(_ACTIVE)
