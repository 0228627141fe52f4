"""Layer 4, the simulated-CUDA runtime for PyTorch (``vram run``; needs the ``torch`` extra):
`runtime` (CUDA tensors on ``meta``, storages charged to the simulated allocator), `kernels`
(workspaces and kernel choices from PyTorch's CUDA source), `cuda_api` (``torch.cuda.*`` answered
by the simulator) and `values` (what a script that reads tensor values is told)."""
