"""Which aten ops the PrivateUse1 engine takes whole (`vram.run.engine.privateuse1`): registered
per op at PrivateUse1, so that no composite kernel decomposes them on the way there."""
from __future__ import annotations

from typing import Any

import torch

from vram.run.kernels import sparse as _sparse

from . import formulas
from .cuda_ops import cuda_kernel_ops

COPY_FROM = torch.ops.aten._copy_from.default
_SET_OVERLOADS = ("source_Tensor", "source_Storage", "source_Storage_storage_offset", "source_Tensor_storage_offset")
SET_SOURCE = frozenset(getattr(torch.ops.aten.set_, o) for o in _SET_OVERLOADS)
#: the ops the fallback takes its own way (`COPY_FROM`, `SET_SOURCE`), by name
_OWN_PATHS = frozenset({"aten::_copy_from", *(f"aten::set_.{o}" for o in _SET_OVERLOADS)})
#: composite ops that reach ``*_overrideable`` kernels on a backend other than CPU/CUDA
_OVERRIDEABLE = frozenset({"aten::convolution", "aten::convolution_backward", "aten::_convolution",
                           "aten::_convolution_double_backward"})
_NON_FUNCTIONAL, _EXPLICIT = "CompositeExplicitAutogradNonFunctional", "CompositeExplicitAutograd"
_IMPLICIT = "CompositeImplicitAutograd"
#: CUDA-kernel ops with a ``CompositeImplicitAutograd`` kernel elsewhere that autograd still handles
#: with a PrivateUse1 kernel registered: ``_fused_rms_norm`` has a derivative of its own
#: (derivatives.yaml); ``mish_backward`` is called by ``MishBackward0`` with grad mode off (CUDA:
#: one output, Activation.cpp; the composite ``math_mish_backward`` makes five input-sized temporaries)
_DIFFERENTIABLE = frozenset({"aten::_fused_rms_norm", "aten::mish_backward"})


def structured_kernels(fallback: Any) -> Any:
    """Send each op with a composite kernel below autograd whole to `fallback` (the engine's), as
    CUDA's own kernel and the default engine's dispatch mode see it.

    A backend without kernels gets those ops through their ``CompositeExplicitAutograd`` or
    ``CompositeExplicitAutogradNonFunctional`` kernels, where CUDA has its own. Structured ops
    (``add``, ``addmm``, ``mse_loss``…) then allocate an output and call the ``out=`` overload
    (``mse_loss``: an input-sized ``empty``, then ``resize_`` to a scalar), an order CUDA never
    has (its generated wrapper allocates each output once, with the meta function's sizes: torchgen
    ``gen_structured``), and ``convolution`` reaches ``convolution_overrideable``, which no backend
    here implements. Registered at PrivateUse1, they run whole on meta instead. (Every
    ``CompositeExplicitAutograd`` op is too many: views, ``detach`` and factories must stay as
    they are for the script's tensors; those that also have a CPU kernel are device kernels with a
    math fallback for other backends, as ``native_layer_norm``/``native_group_norm``'s
    ``math_*_norm``, whose temporaries CUDA's kernels never allocate. So are ops that CUDA has a
    kernel for (`cuda_kernel_ops`) with only a composite elsewhere: ``_foreach_*`` (one fused
    launch, not one op per tensor), ``_chunk_cat`` (FSDP2's reduce-scatter input), and
    ``_fused_rms_norm``, whose ``CompositeImplicitAutograd`` upcasts and saves other tensors.)

    Every other aten op without a composite kernel is registered here too, though the fallback
    would run it the same way: a Python *fallback* called while a dispatch mode is on the stack
    but the Python key is excluded (``torch.tensor(data, device=)``: ``internal_new_from_data``)
    goes through ``python_op_registration_trampoline``, which finds only per-op registrations
    (torch/csrc/utils/python_dispatch.cpp, ``PythonKernelHolder``: ``func != nullptr`` fails).
    The fallback stays for other namespaces and ops registered later."""
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    cuda = cuda_kernel_ops()
    # which ops have a kernel at each key: one dispatcher query per key (asking per op and key
    # is as many name lookups as ops, a second of start-up)
    kernels = {k: frozenset(torch._C._dispatch_get_registrations_for_dispatch_key(k))
               for k in ("CPU", _NON_FUNCTIONAL, _EXPLICIT, _IMPLICIT)}

    def _has(qualified: str, key: str) -> bool:
        return qualified in kernels[key]
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        whole = qualified in _OVERRIDEABLE or _has(qualified, _NON_FUNCTIONAL) or (
            (_has(qualified, "CPU") or qualified in cuda) and _has(qualified, _EXPLICIT)) or (
            qualified in cuda and qualified in _DIFFERENTIABLE)
        if not whole and any(_has(qualified, k) for k in (_IMPLICIT, _EXPLICIT)):
            continue  # a composite that decomposes into ops that come here
        if (whole and qualified in _OWN_PATHS) or qualified[6:] in _sparse.DENSE_TO_SPARSE:
            continue  # (the dense-to-sparse conversions: `sparse_layouts`)
        lib.impl(qualified[len("aten::"):], _whole(fallback, name, overload or "default"), "PrivateUse1")
    formulas.register(lib)
    return lib


def _whole(fallback: Any, packet: str, overload: str) -> Any:
    """The kernel that sends ``aten::packet.overload`` to `fallback`; its ``OpOverload`` looked up
    on the first call (looking up all of them is a tenth of a second of every start)."""
    found: list[Any] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not found:
            found.append(getattr(getattr(torch.ops.aten, packet), overload))
        return fallback(found[0], *args, **kwargs)
    return kernel
