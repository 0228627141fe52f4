"""``torch.compile`` for CUDA on a machine without a GPU: Inductor's CUDA wrapper, as a GPU build
generates it, from a CPU build of torch.

What lives here:

- `cuda_process`: turns a fresh Python process into one where Inductor compiles for ``cuda``
  (AOTAutograd's joint trace, the partitioner, Inductor's lowering, scheduling, memory planning and
  Python wrapper codegen) with no GPU and no Triton kernel ever built. It must run before torch is
  imported: a CPU build's ``at::getAccelerator()`` knows no CUDA, so the autograd engine refuses
  every backward over CUDA tensors (``InputBuffer::add`` asks ``at::accelerator::getCurrentStream``),
  and a PrivateUse1 backend (the ``vramsim`` engine) cannot be unregistered. Hence a separate
  process: the one that runs the script has PrivateUse1 registered.
- `inductor_cuda`: compiles one Dynamo graph there (devices retargeted to ``cuda``, SDPA routed to
  the CUDA kernel ``select_sdp_backend`` picks) and returns the generated wrappers' sources.
- `wrapper_plan`: reads a generated wrapper's ``call``: the buffers it allocates, in order.
- `wrapper_run`: runs a generated wrapper on the simulated GPU (inside ``simulated_cuda``):
  Triton launches are no-ops, its buffers and extern kernels are charged as on a GPU.

Who may import it: `vram.run.runtime` (the entry points) and tests. It imports `vram.run.kernels`
(SDPA's backend choice) and `vram.run.cuda` (the card's properties), nothing above it.
"""
