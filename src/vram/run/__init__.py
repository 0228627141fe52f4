"""Layer 4, the simulated-CUDA runtime for PyTorch (``vram run``; needs the ``torch`` extra):
`runtime` (CUDA tensors on ``meta``, storages charged to the simulated allocator), `kernels`
(workspaces and kernel choices from PyTorch's CUDA source), `cuda_api` (``torch.cuda.*`` answered
by the simulator) and `values` (what a script that reads tensor values is told)."""

__all__ = ["run_script", "simulated_cuda"]


def __getattr__(name: str) -> object:
    """``from vram.run import simulated_cuda`` (and ``run_script``): the public entry points,
    imported from `vram.run.runtime` when first asked for (importing torch then, not before)."""
    if name in __all__:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'vram.run' has no attribute {name!r}")
