"""Half-precision ``torch.fft`` on the simulated GPU, as CUDA runs it (layer 4; needs torch).

``torch.fft``'s functions are composites (``aten/src/ATen/native/SpectralOps.cpp``) whose dtype
check, ``promote_type_fft``, accepts ``Half`` only on a CUDA (or meta) device: on the simulated
device it refuses with "Unsupported dtype Half" where a GPU computes. For a float16 or complex32
input on the simulated GPU, `half_fft` runs the same composite here, step for step, down to the
``_fft_r2c`` / ``_fft_c2r`` / ``_fft_c2c`` kernels, whose allocations `vram.run.kernels.cufft`
charges (and where cuFFT's half-precision rule, power-of-two signal sizes, refuses as CUDA does):

* ``promote_tensor_fft``: a real input is made complex (``t.to(kComplexHalf)``, a new tensor)
  where the transform needs a complex one (``fftn``, ``ifftn``, ``irfft``, ``hfft``, ``irfftn``);
* ``resize_fft_input``: ``n`` / ``s`` smaller than the input slices (a view), larger pads with
  ``constant_pad_nd`` (a copy);
* ``norm_from_string``: the normalization goes to the kernel (``none``, ``by_root_n``, ``by_n``),
  which scales its output in place; ``hfft`` conjugates its input (a view), ``ifft`` / ``ihfft``
  of a real input conjugate the result (a view; ``conj_physical_out`` into ``out=``).

Every ``torch.fft`` transform is ported (``fft`` … ``ihfftn`` and the 2-D forms); ``stft`` /
``istft`` call the kernels themselves and need no port.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_HALF = (torch.float16, torch.complex32)
_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}
_R2C, _C2R, _C2C = torch.ops.aten._fft_r2c, torch.ops.aten._fft_c2r, torch.ops.aten._fft_c2c
#: ``fft_norm_mode`` (SpectralOpsUtils.h)
NONE, BY_ROOT_N, BY_N = 0, 1, 2


def _norm(norm: str | None, forward: bool) -> int:
    """``norm_from_string``."""
    if norm is None or norm == "backward":
        return NONE if forward else BY_N
    if norm == "forward":
        return BY_N if forward else NONE
    if norm == "ortho":
        return BY_ROOT_N
    raise RuntimeError(f'Invalid normalization mode: "{norm}"')


def _promote(t: torch.Tensor, require_complex: bool) -> torch.Tensor:
    """``promote_tensor_fft`` on a CUDA device (Half allowed)."""
    if t.is_complex() or not require_complex:
        return t
    return t.to(_COMPLEX[t.dtype])


def _wrap(dim: int, ndim: int) -> int:
    """``maybe_wrap_dim(dim, ndim, /*wrap_scalar=*/false)``."""
    if ndim == 0:
        raise IndexError(f"dimension specified as {dim} but tensor has no dimensions")
    if not -ndim <= dim < ndim:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    return dim % ndim


def _resize(x: torch.Tensor, dims: list[int], sizes: list[int]) -> torch.Tensor:
    """``resize_fft_input``: slice what is longer, pad (one copy) what is shorter."""
    pad = [0] * (2 * x.dim())
    must_copy = False
    for d, n in zip(dims, sizes):
        if n == -1:
            continue
        if x.size(d) < n:
            must_copy = True
            pad[len(pad) - 2 * d - 1] = n - x.size(d)
        if x.size(d) > n:
            x = x.narrow(d, 0, n)
    return torch.constant_pad_nd(x, pad) if must_copy else x


def _sized(x: torch.Tensor, n: int | None, dim: int) -> tuple[torch.Tensor, int]:
    """A 1-D transform's wrapped dim and its input resized to `n` points (``fft_r2c``/``fft_c2c``)."""
    dim = _wrap(dim, x.dim())
    size = n if n is not None else x.size(dim)
    if size < 1:
        raise RuntimeError(f"Invalid number of data points ({size}) specified")
    return (x if n is None else _resize(x, [dim], [size])), dim


def _kernel(op: Any, out: torch.Tensor | None, *args: Any) -> torch.Tensor:
    """``fft_*_maybe_out``: the functional kernel, or its ``out=`` overload."""
    return op(*args) if out is None else op.out(*args, out=out)


def _c2r(out: torch.Tensor | None, x: torch.Tensor, n: int | None, dim: int, norm: str | None,
         forward: bool) -> torch.Tensor:
    """``fft_c2r`` (``irfft``; ``hfft`` is the forward one, on the conjugated input)."""
    x = _promote(x, True)
    dim = _wrap(dim, x.dim())
    last = n if n is not None else 2 * (x.size(dim) - 1)
    if last < 1:
        raise RuntimeError(f"Invalid number of data points ({last}) specified")
    if n is not None:
        x = _resize(x, [dim], [last // 2 + 1])
    mode = _norm(norm, forward)
    if forward:
        x = x.conj()
    return _kernel(_C2R, out, x, [dim], mode, last)


def _r2c(name: str, out: torch.Tensor | None, x: torch.Tensor, n: int | None, dim: int, norm: str | None,
         forward: bool, onesided: bool) -> torch.Tensor:
    """``fft_r2c`` (``fft``/``ifft`` of a real input, ``rfft``, ``ihfft``)."""
    if x.is_complex():
        raise RuntimeError(f"{name} expects a real input tensor, but got {x.dtype}")
    x, dim = _sized(x, n, dim)
    mode = _norm(norm, forward)
    ret = _kernel(_R2C, out if forward else None, x, [dim], mode, onesided)
    if forward:
        return ret
    return torch.conj_physical(ret, out=out) if out is not None else ret.conj()


def _c2c(out: torch.Tensor | None, x: torch.Tensor, n: int | None, dim: int, norm: str | None,
         forward: bool) -> torch.Tensor:
    """``fft_c2c``."""
    x, dim = _sized(x, n, dim)
    return _kernel(_C2C, out, x, [dim], _norm(norm, forward), forward)


def _shape_and_dims(x: torch.Tensor, s: Any, dim: Any) -> tuple[list[int], list[int]]:
    """``canonicalize_fft_shape_and_dim_args``: the transform's shape and wrapped dims."""
    dims = None if dim is None else [_wrap(int(d), x.dim()) for d in ([dim] if isinstance(dim, int) else dim)]
    if dims is not None and len(set(dims)) != len(dims):
        raise RuntimeError("FFT dims must be unique")
    if s is not None:
        shape = [int(n) for n in s]
        if dims is not None and len(dims) != len(shape):
            raise RuntimeError("When given, dim and shape arguments must have the same length")
        if len(shape) > x.dim():
            raise RuntimeError(f"Got shape with {len(shape)} values but input tensor only has {x.dim()} dimensions.")
        dims = dims if dims is not None else list(range(x.dim() - len(shape), x.dim()))
        shape = [x.size(d) if n == -1 else n for n, d in zip(shape, dims)]
    else:
        dims = dims if dims is not None else list(range(x.dim()))
        shape = [x.size(d) for d in dims]
    for n in shape:
        if n <= 0:
            raise RuntimeError(f"Invalid number of data points ({n}) specified")
    return shape, dims


def _fftn(out: torch.Tensor | None, x: torch.Tensor, s: Any, dim: Any, norm: str | None,
          forward: bool) -> torch.Tensor:
    """``fft_fftn`` / ``fft_ifftn``: promoted to complex, resized, one ``_fft_c2c`` (the promoted
    and the resized tensors are both locals there: they live until it returns)."""
    shape, dims = _shape_and_dims(x, s, dim)
    promoted = _promote(x, True)
    return _kernel(_C2C, out, _resize(promoted, dims, shape), dims, _norm(norm, forward), forward)


def _rfftn(out: torch.Tensor | None, x: torch.Tensor, s: Any, dim: Any, norm: str | None) -> torch.Tensor:
    """``fft_rfftn_impl``."""
    if x.is_complex():
        raise RuntimeError(f"rfftn expects a real-valued input tensor, but got {x.dtype}")
    shape, dims = _shape_and_dims(x, s, dim)
    if not shape:
        raise RuntimeError("rfftn must transform at least one axis")
    return _kernel(_R2C, out, _resize(x, dims, shape), dims, _norm(norm, True), True)


def _c2r_shape(name: str, x: torch.Tensor, s: Any, dim: Any) -> tuple[list[int], list[int], int]:
    """``canonicalize_fft_c2r_shape_and_dim_args``: the shape (its last entry the input size
    ``last / 2 + 1``), the dims, and the last dim's output size ``last``."""
    shape, dims = _shape_and_dims(x, s, dim)
    if not shape:
        raise RuntimeError(f"{name} must transform at least one axis")
    last = 2 * (x.size(dims[-1]) - 1) if s is None or list(s)[-1] == -1 else shape[-1]
    if last < 1:
        raise RuntimeError(f"Invalid number of data points ({last}) specified")
    shape[-1] = last // 2 + 1
    return shape, dims, last


def _irfftn(out: torch.Tensor | None, x: torch.Tensor, s: Any, dim: Any, norm: str | None) -> torch.Tensor:
    """``fft_irfftn_impl``: promoted to complex, resized, one ``_fft_c2r``."""
    shape, dims, last = _c2r_shape("irfftn", x, s, dim)
    promoted = _promote(x, True)
    return _kernel(_C2R, out, _resize(promoted, dims, shape), dims, _norm(norm, False), last)


def _hfftn(out: torch.Tensor | None, x: torch.Tensor, s: Any, dim: Any, norm: str | None) -> torch.Tensor:
    """``fft_hfftn_impl``: promoted, resized; a ``_fft_c2c`` over all but the last dim (more than
    one), conjugated (a view), then ``_fft_c2r`` of the last dim."""
    shape, dims, last = _c2r_shape("hfftn", x, s, dim)
    promoted = _promote(x, True)
    resized = _resize(promoted, dims, shape)
    mode = _norm(norm, True)
    tmp = _C2C(resized, dims[:-1], mode, True) if len(dims) > 1 else resized
    return _kernel(_C2R, out, tmp.conj(), [dims[-1]], mode, last)


def _ihfftn(out: torch.Tensor | None, x: torch.Tensor, s: Any, dim: Any, norm: str | None) -> torch.Tensor:
    """``fft_ihfftn_impl``: resized; ``_fft_r2c`` of the last dim; one dim: its conjugate (a view,
    or ``at::conj_physical_out(tmp, out)`` as written there); more: ``conj_physical`` (a new
    tensor), then ``_fft_c2c`` of the other dims."""
    shape, dims = _shape_and_dims(x, s, dim)
    if not shape:
        raise RuntimeError("ihfftn must transform at least one axis")
    mode = _norm(norm, False)
    tmp = _R2C(_resize(x, dims, shape), [dims[-1]], mode, True)
    if len(dims) == 1:
        return tmp.conj() if out is None else torch.conj_physical(out, out=tmp)
    tmp = torch.conj_physical(tmp)  # the transform's output goes as its conjugate replaces it
    return _kernel(_C2C, out, tmp, dims[:-1], mode, False)


def _one(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A 1-D function's signature ``(input, n=None, dim=-1, norm=None, *, out=None)``."""
    def call(input: torch.Tensor, n: int | None = None, dim: int = -1, norm: str | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        return run(out, input, n, dim, norm)
    return call


def _many(run: Callable[..., torch.Tensor], default_dim: Any) -> Callable[..., torch.Tensor]:
    """An n-D function's signature ``(input, s=None, dim=..., norm=None, *, out=None)``."""
    def call(input: torch.Tensor, s: Any = None, dim: Any = default_dim, norm: str | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        return run(out, input, s, dim, norm)
    return call


def _either(forward: bool, name: str) -> Callable[..., torch.Tensor]:
    """``fft`` / ``ifft``: c2c for a complex input, a two-sided r2c for a real one."""
    def run(out: Any, x: torch.Tensor, n: Any, dim: int, norm: Any) -> torch.Tensor:
        if x.is_complex():
            return _c2c(out, x, n, dim, norm, forward)
        return _r2c(name, out, x, n, dim, norm, forward, False)
    return _one(run)


_TWO = (-2, -1)
#: the ``torch.fft`` functions ported here, as CUDA's composites run them
HALF_FFT: dict[Any, Callable[..., torch.Tensor]] = {
    torch.fft.fft: _either(True, "fft"),
    torch.fft.ifft: _either(False, "ifft"),
    torch.fft.rfft: _one(lambda o, x, n, d, m: _r2c("rfft", o, x, n, d, m, True, True)),
    torch.fft.ihfft: _one(lambda o, x, n, d, m: _r2c("ihfft", o, x, n, d, m, False, True)),
    torch.fft.irfft: _one(lambda o, x, n, d, m: _c2r(o, x, n, d, m, False)),
    torch.fft.hfft: _one(lambda o, x, n, d, m: _c2r(o, x, n, d, m, True)),
    torch.fft.fftn: _many(lambda o, x, s, d, m: _fftn(o, x, s, d, m, True), None),
    torch.fft.ifftn: _many(lambda o, x, s, d, m: _fftn(o, x, s, d, m, False), None),
    torch.fft.fft2: _many(lambda o, x, s, d, m: _fftn(o, x, s, d, m, True), _TWO),
    torch.fft.ifft2: _many(lambda o, x, s, d, m: _fftn(o, x, s, d, m, False), _TWO),
    torch.fft.rfftn: _many(_rfftn, None),
    torch.fft.rfft2: _many(_rfftn, _TWO),
    torch.fft.irfftn: _many(_irfftn, None),
    torch.fft.irfft2: _many(_irfftn, _TWO),
    torch.fft.hfftn: _many(_hfftn, None),
    torch.fft.hfft2: _many(_hfftn, _TWO),
    torch.fft.ihfftn: _many(_ihfftn, None),
    torch.fft.ihfft2: _many(_ihfftn, _TWO),
}


def half_fft(func: Any, args: Any, kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """The call of a ported ``torch.fft`` function on a float16 / complex32 input (module doc);
    None for any other call."""
    run = HALF_FFT.get(func)
    x = args[0] if args else kwargs.get("input")
    if run is None or not isinstance(x, torch.Tensor) or x.dtype not in _HALF:
        return None
    return lambda: run(*args, **kwargs)
