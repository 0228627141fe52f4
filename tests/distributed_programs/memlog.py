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


def start(tracker):
    """Initialise as a tracker comparison does; returns ``(device, baseline)``. With `tracker`:
    rank 0 of 2 on the CPU with PyTorch's fake process group, storages rounded to 512 bytes as
    ``mem_tracker._WeakRefInfo`` rounds CUDA ones (baseline 0); else the script's simulated GPU
    after the workspaces exist, the peak reset."""
    import os

    import torch.distributed as dist
    if tracker:
        from torch.distributed._tools import mem_tracker
        from torch.testing._internal.distributed import fake_pg  # noqa: F401  registers backend "fake"

        def rounded(self):
            return -(-self.size * self.element_size // 512) * 512
        mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
        dist.init_process_group("fake", rank=0, world_size=2)
        return torch.device("cpu"), 0
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")
    pre = warm_up()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return dev, pre
