"""What the distributed test programs print: ``name allocated peak``, bytes over a baseline taken
after the cuBLAS/cuBLASLt workspaces exist (a Linear forward and backward with a batch > 1, as
PyTorch's test_fsdp2_mem_tracker.py warms up), the peak reset after each line."""
import torch
import torch.nn as nn

_pre = [0]


def warm_up():
    """Create the workspaces; returns the baseline."""
    lin = nn.Linear(768, 768, device="cuda")
    lin(torch.randn(2, 768, device="cuda")).sum().backward()
    del lin
    _pre[0] = torch.cuda.memory_allocated()
    return _pre[0]


def show(name):
    pre = _pre[0]
    print(name, torch.cuda.memory_allocated() - pre, torch.cuda.max_memory_allocated() - pre)
    torch.cuda.reset_peak_memory_stats()
