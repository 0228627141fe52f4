"""The ``torch.cuda`` surface of a simulated run, and CUDA builds' libraries beside a CPU torch.

- `api`: ``torch.cuda.*`` answered by the simulator: device count and properties, the memory
  API (``memory_allocated``, ``memory_summary``, ``_record_memory_history``...), streams and
  events, graphs and ``MemPool``, NVTX, ``torch.accelerator``.
- `patches`: what a simulated run patches outside ``torch.cuda``: autocast's cache, GradScaler,
  ``Module.to``, ``record_stream``, ``UntypedStorage.resize_``, the autograd engine under the
  function mode, ``torch.compile``, pinned memory, the profiler.
- `stand_ins`: ``torch.device(index)`` and ``torch.Generator(device="cuda")`` as a GPU build
  makes them, and the attribute patches that install and undo every patch.
- `comm`: ``torch.cuda.comm``'s C++ half (scatter, gather, broadcast for ``nn.DataParallel``).
- `compat`: a torchvision built for CUDA next to a CPU build of torch (its C++ ops defined).

The bottom of the run floor: imports the simulated allocator (`vram.frontend`) and nothing of
`vram.run`.
"""
