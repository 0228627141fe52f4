"""The engine of ``vram run`` and ``vram estimate``: how a simulated tensor exists and every aten
op on it runs, for every mode (one GPU, ``--devices N``, ranks, estimate's layouts).

Simulated tensors live on PyTorch's PrivateUse1 device, named `NAME`, set up as a Python backend
(``torch.utils.backend_registration``) whose device guard and hooks are C++ (`native`,
``_device.cpp``: a device per simulated GPU, so the autograd engine has a queue for each, and
pinned host memory). One boxed fallback (`privateuse1`, ``torch.library.Library.fallback``) runs
each op on meta views of its inputs and gives every new output a storage made through DLPack
(`dlpack`) at its simulated address, charged to the simulated allocator in the kernel's order
(`vram.run.kernels.plan.op_plan`) and freed by the storage's deleter; a call seen before takes its
meta run from `meta_cache` (torch's meta kernels are mostly Python; `cpp_meta` puts the C++ ones
back where they give the same), and each op's schema facts are
read once (`op_info`). No dispatch mode while the
model trains: autograd sees plain tensors and takes the GPU's formulas (`formulas`: the backward
kernels CUDA has). The function mode (`function_mode`; `privateuse1.BackendFunctionMode`) plays
the CUDA tensor to the script; `reads` answers reads of values, `outputs` data-dependent shapes
and cuBLAS workspaces, `lazy` lazy host tensors' ops, `views` views that change the dtype and
copies of conjugate/negative views, `dynamo_guard` the import of ``torch._dynamo`` only once
something compiles. `meta` is the meta engine, a debugging aid
(``--backend meta``): meta tensors under a dispatch mode, "subclass-like" to
``at::isTensorSubclassLike`` (``ATen/TensorSubclassLikeUtils.h``), so its backward takes
out-of-place formulas a GPU does not. Imported by `vram.run.runtime` and `vram.run.distributed`.
"""
from . import native
from .privateuse1 import NAME, BackendFunctionMode, BackendState, EngineLimit, register

__all__ = ["NAME", "BackendFunctionMode", "BackendState", "EngineLimit", "native", "register"]
