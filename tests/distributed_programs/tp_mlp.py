"""Tensor parallel MLP (Megatron-style: column-wise up projection, row-wise down projection)
through DTensor's ``parallelize_module``; prints ``name allocated peak`` (bytes over a warmed-up
baseline) after building, parallelizing, the forward and the backward.

With ``--tracker``: rank 0 of 2 on the CPU with PyTorch's fake process group under
``torch.distributed._tools.mem_tracker.MemTracker``, printing its peaks ``forward peak`` and
``backward peak`` (storages 512-byte rounded, as the tracker rounds CUDA ones)."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from memlog import show, warm_up
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(1024, 4096, bias=False)
        self.down = nn.Linear(4096, 1024, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


if "--tracker" in sys.argv:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers backend "fake"
    from torch.distributed._tools import mem_tracker

    def rounded(self):
        return -(-self.size * self.element_size // 512) * 512
    mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    dist.init_process_group("fake", rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    model = parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(8, 1024)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model, x)
    with tracker:
        y = model(x)
        print("forward", tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
        y.sum().backward()
    print("backward", tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    sys.exit()
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (int(os.environ["WORLD_SIZE"]),))
pre = warm_up()


model = MLP().cuda()
torch.cuda.reset_peak_memory_stats()
show("built")
model = parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
show("parallel")
print("local", tuple(model.up.weight.to_local().shape), tuple(model.down.weight.to_local().shape))
x = torch.randn(8, 1024, device="cuda")
y = model(x)
show("forward")
y.sum().backward()
show("backward")
dist.destroy_process_group()
