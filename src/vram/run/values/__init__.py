"""What a simulated GPU knows of tensor contents, so a script's control flow takes the GPU's branch.

- `known`: values known without the model's arithmetic (factories, host data, masks, ids), kept
  as CPU copies and propagated through small ops.
- `placeholders`: reads of values the simulation does not have: the placeholder report, the
  script line that read them, `DataDependentError`.
- `real_values`: ``--values real``: every value computed on the CPU, with CPU values for
  CUDA-only kernels (fused attention forward and backward, integer ``histc``).
- `limits`: how much a run keeps on the host, `HostMemoryError`.

The run's state (`vram.run.memory.storages.SimState`) is handed in by the engine; this package
imports only `vram.run.cuda` of the run floor.
"""
