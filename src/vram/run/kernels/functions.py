"""Python-level torch functions a simulated run sees whole or goes through: the ones whose inner
torch calls must meet the function mode (`TRANSPARENT`), and what CUDA runs in place of a generic
composite (`cuda_variant`: softmax's half-to-float kernel, half-precision ``torch.fft``).
"""
from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .cufft_half import half_fft

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


def clone_with_globals(func: Any, **names: Any) -> Any:
    """A copy of the Python function `func` that sees `names` in place of its module's globals."""
    clone = types.FunctionType(func.__code__, dict(func.__globals__, **names), func.__name__, func.__defaults__,
                               func.__closure__)
    clone.__kwdefaults__ = func.__kwdefaults__
    clone.__qualname__, clone.__doc__, clone.__module__ = func.__qualname__, func.__doc__, func.__module__
    return clone


def transparent(func: Any) -> Any:
    """`func` (one of `TRANSPARENT`) as a copy that does not hand itself to torch-function modes."""
    clone = _CLONES.get(func)
    if clone is None:
        clone = _CLONES[func] = clone_with_globals(func, has_torch_function=_never, has_torch_function_unary=_never,
                                                   has_torch_function_variadic=_never)
    return clone


#: softmax-family entry points, and where their (input, dim, dtype) arguments sit
_SOFTMAX_KERNELS = {"softmax": torch.ops.aten._softmax.default, "log_softmax": torch.ops.aten._log_softmax.default}
_FUNCTIONAL_SOFTMAX = frozenset({F.softmax, F.log_softmax})


def half_to_float_softmax(func: Any, name: str, args: Any, kwargs: dict[str, Any]) -> Callable[[], Any] | None:
    """CUDA's ``softmax(half, dim, dtype=float32)``: one ``_softmax(x, dim, half_to_float=True)``
    launch, no float copy of the input (SoftMax.cpp: ``input_.is_cuda() && Half && dtype ==
    Float``; every other device casts first). Autocast's fp32_set_opt_dtype makes this the usual
    fp16 attention softmax. None when the call is not that case."""
    kernel = _SOFTMAX_KERNELS.get(name)
    if kernel is None or not args or not isinstance(args[0], torch.Tensor) or args[0].dtype != torch.float16:
        return None
    names = ("input", "dim", "_stacklevel", "dtype") if func in _FUNCTIONAL_SOFTMAX else ("input", "dim", "dtype")
    given = dict(zip(names, args), **kwargs)
    dim = given.get("dim")
    if given.get("dtype") != torch.float32 or not isinstance(dim, int):
        return None
    x = given["input"]
    return lambda: kernel(x, dim, True)


def cuda_variant(func: Any, name: str, args: Any, kwargs: dict[str, Any],
                 again: Callable[[Callable[[], Any]], Any]) -> Callable[[], Any] | None:
    """The call CUDA makes of `func` where the simulated device would take another path:
    `half_to_float_softmax`, or a half-precision ``torch.fft`` function run step by step
    (`vram.run.kernels.cufft_half.half_fft`, through `again`: with the function mode pushed, so
    that its inner calls meet it); None for other calls."""
    if name in _SOFTMAX_KERNELS:
        return half_to_float_softmax(func, name, args, kwargs)
    run = half_fft(func, args, kwargs)
    return None if run is None else lambda: again(run)


def setitem_on_host(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``tensor[index] = number`` as CUDA runs it: ``THPVariable_setitem`` makes the number a 0-dim
    tensor of the tensor's dtype *on the host* for a CUDA tensor (python_variable_indexing.cpp
    ``valueToTensor(.., at::Device(kCPU))``), so ``copy_to`` fills without a GPU scalar and a mask
    takes ``masked_fill_``; a simulated tensor's device is not CUDA to that code, so the number is
    made a host tensor here first."""
    if len(args) == 3 and isinstance(args[0], torch.Tensor) and isinstance(args[2], (bool, int, float, complex)):
        return (args[0], args[1], torch.scalar_tensor(args[2], dtype=args[0].dtype, device="cpu"))
    return args
