"""The simulated GPU's storages as a run charges them, and host tensors.

- `storages`: `SimState` (what one run has charged: live storages by identity, workspaces, the
  running call's redirect, the value settings) and `ChargedStorage` (one storage's block, device
  and known value).
- `storage_api`: storages where no dispatch sees them: ``UntypedStorage(n, device="cuda")``,
  ``data_ptr()``, ``torch.load(map_location="cuda")``, checkpoint location tags.
- `lazy_host`: host tensors that cost nothing until something needs their bytes.
- `host_rng`: the CPU generator's stream when host tensors are lazy, so draws match eager CPU.

Imported by `vram.run.engine`, `vram.run.kernels`' callers and `vram.run.distributed`; imports
`vram.run.values` and `vram.run.cuda`.
"""
