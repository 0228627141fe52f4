"""The simulated-CUDA runtime for PyTorch: ``vram run`` (needs the ``torch`` extra).

An unmodified PyTorch script runs as if on CUDA GPUs: every storage a CUDA kernel would allocate
is charged to vram's caching allocator when PyTorch would allocate it, and freed when its last
reference dies. The floor is built of sub-packages, each one idea, each importing only the ones
listed after it (``[tool.importlinter]`` in pyproject.toml checks it):

- `runtime`: the entry points, `simulated_cuda` and `run_script`: sets up the engine, patches
  ``torch.cuda`` and runs the script.
- `compile`: ``torch.compile`` for CUDA without a GPU: a process where Inductor generates its
  CUDA wrapper on a CPU build, and what a generated wrapper allocates (not yet wired into
  ``vram run``: ``torch.compile`` still runs eagerly there).
- `distributed`: many GPUs: ``torch.distributed``'s NCCL and Gloo process groups, collectives,
  DDP's helpers, the ``--nproc-per-node`` launcher and one rank's process.
- `engine`: how a simulated tensor exists and every aten op on it runs: the PrivateUse1 backend
  (the default), its autograd formulas and lazy host tensors' dispatch; the meta-tensor modes.
- `kernels`: what each CUDA kernel allocates beyond its outputs, in its order: cuBLAS, cuDNN
  batch norm, reductions, norms and embedding backward scratch, attention (SDPA backends),
  grouped mm, the fused transformer fast paths, autocast's casts.
- `memory`: the charged storages (`SimState`, `ChargedStorage`), storage-level moves, host
  tensors that cost nothing until read, the host generator's stream.
- `values`: what a simulated GPU knows of tensor contents: known values, placeholders and the
  report of where they were used, real values computed on the CPU, and the rerun with real
  values of a default run that meets a data-dependent shape.
- `cuda`: the ``torch.cuda`` surface answered by the simulator (device properties, memory API,
  streams, ``torch.cuda.comm``) and CUDA builds' libraries beside a CPU torch.
"""

__all__ = ["run_script", "simulated_cuda"]


def __getattr__(name: str) -> object:
    """``from vram.run import simulated_cuda`` (and ``run_script``): the public entry points,
    imported from `vram.run.runtime` when first asked for (importing torch then, not before)."""
    if name in __all__:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module 'vram.run' has no attribute {name!r}")
