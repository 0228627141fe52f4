"""``torch.compile`` for CUDA on a machine without a GPU: Inductor's CUDA wrapper, as a GPU build
generates it, from a CPU build of torch, run on the simulated GPU under ``vram run``.

What lives here:

- `backend`: ``torch.compile`` under a run: Dynamo traces the script (the run's function mode left
  out of its trace), and its backend sends each graph to the compile process and returns a
  `compiled_graph.CompiledGraph`; what is not modelled is said once and runs eagerly or as
  default mode.
- `client` (the run's side) and `worker` (``python -m vram.run.compile.worker``): the compile
  process, started at the first graph and reused; compiled wrappers cached by graph, in the run and
  on disk. `graph_transport`: a graph sent node by node.
- `cuda_process`: turns a fresh Python process into one where Inductor compiles for ``cuda``
  (AOTAutograd's joint trace, the partitioner, Inductor's lowering, scheduling, memory planning and
  Python wrapper codegen) with no GPU and no Triton kernel ever built. It must run before torch is
  imported: a CPU build's ``at::getAccelerator()`` knows no CUDA, so the autograd engine refuses
  every backward over CUDA tensors (``InputBuffer::add`` asks ``at::accelerator::getCurrentStream``),
  and a PrivateUse1 backend (the ``vramsim`` engine) cannot be unregistered. Hence a separate
  process: the one that runs the script has PrivateUse1 registered.
- `inductor_cuda`: compiles one Dynamo graph there (devices retargeted to ``cuda``, SDPA routed to
  the CUDA kernel ``select_sdp_backend`` picks) and returns the generated wrappers' sources and
  AOTAutograd's runtime layout (`runtime_meta`: its ``ViewAndMutationMeta`` as plain data).
- `wrapper_plan`: reads a generated wrapper's ``call``: the buffers it allocates, in order.
- `wrapper_run`: runs a generated wrapper on the simulated GPU (inside ``simulated_cuda``):
  Triton launches are no-ops but for first-launch autotuning (`autotune`), its buffers and extern
  kernels are charged as on a GPU. `compiled_graph`: AOTAutograd's runtime around the wrappers
  (input mutations copied back, aliased outputs made again from their base, the forward and
  backward inside an ``autograd.Function``).
- `cudagraph_trees`: ``mode="reduce-overhead"``: each graph partition run in a model of
  Inductor's CUDA graph trees (warm-up, recording and replay in the tree's private pool).
- `max_autotune`: ``max-autotune``: Inductor's choice without benchmarks, the compile-time
  benchmarks' allocations, and how much a GPU's own choice could differ.

Who may import it: `vram.run.runtime` (the entry points) and tests. It imports `vram.run.kernels`
(SDPA's backend choice) and `vram.run.cuda` (the card's properties, attribute patches), nothing
above it.
"""
