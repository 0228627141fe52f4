"""The PrivateUse1 engine of ``vram run``: the default for one process on one GPU (issue 12).

The older ``meta`` engine (``--backend meta``; several GPUs, distributed ranks) keeps simulated
tensors on ``meta`` under a ``TorchDispatchMode``; both make
every tensor "subclass-like" to ``at::isTensorSubclassLike`` (``ATen/TensorSubclassLikeUtils.h``),
so backward formulas take out-of-place paths a GPU does not. Here simulated tensors live on
PyTorch's PrivateUse1 device, set up as a Python backend
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, over
``torch._C._acc``; torch/csrc/acc/, c10/core/impl/PyInterpreter*): one boxed fallback
(``torch.library.Library.fallback``) runs each op on meta and gives every new output a storage
made through DLPack (`vram.run.engine.dlpack`), charged to the simulated allocator in the
kernel's order (`vram.run.kernels.plan.op_plan`) and freed by the storage's deleter. No dispatch mode,
no meta key, no storage Python object: autograd sees plain tensors. A function mode
(`vram.run.engine.privateuse1.BackendFunctionMode`, the default engine's `FunctionMode` with
``cuda`` sent here instead of to meta) plays the CUDA tensor to the script.
"""
from . import native
from .privateuse1 import NAME, BackendFunctionMode, BackendState, EngineLimit, register

__all__ = ["NAME", "BackendFunctionMode", "BackendState", "EngineLimit", "native", "register"]
