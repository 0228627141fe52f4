"""The training loop `vram estimate --ddp/--fsdp` runs, written by hand: the model of
``tiny_stack.stack`` under DDP, FSDP2 (each block, then the root) or HSDP (``--hsdp R``: FSDP2 over
a 2-D (replicate, shard) mesh), Adam, three steps of a fresh 64 x 256 batch each; prints the peak
allocated over iterations 2-3 (the estimate's steady state).

Under ``vram run --nproc-per-node`` it reads ``torch.cuda.max_memory_allocated`` after resetting
the peak before iteration 2. With ``--tracker`` it is rank 0 on the CPU with PyTorch's fake process
group and prints the peak "Total" of ``FSDPMemTracker`` (FSDP, HSDP) or ``MemTracker`` (DDP) over
iterations 2-3, storages rounded to 512 bytes as the trackers round CUDA ones."""
import argparse
import os

import torch
import torch.distributed as dist
from tiny_stack import stack
from torch.distributed.device_mesh import init_device_mesh

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["ddp", "fsdp", "hsdp"])
p.add_argument("--world", type=int, default=2)
p.add_argument("--replicate", type=int, default=2, help="HSDP: replicas (the shard degree is world / this)")
p.add_argument("--tracker", action="store_true")
a = p.parse_args()

if a.tracker:
    from torch.distributed._tools import mem_tracker
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  registers backend "fake"

    def rounded(self):
        return -(-self.size * self.element_size // 512) * 512
    mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    dist.init_process_group("fake", rank=0, world_size=a.world)
    dev = torch.device("cpu")
else:
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")

if a.mode == "ddp":
    model = stack().to(dev)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=None if a.tracker else [dev.index])
else:
    from torch.distributed.fsdp import fully_shard
    if a.mode == "hsdp":
        mesh = init_device_mesh(dev.type, (a.replicate, a.world // a.replicate),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh(dev.type, (a.world,), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        model = stack()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)


def step():
    global x
    x = torch.empty(64, 256, device=dev)
    out = model(x)
    loss = out.sum()
    del out
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)


step()
if a.tracker:
    if a.mode == "ddp":
        from torch.distributed._tools.mem_tracker import MemTracker
        tracker = MemTracker()
        tracker.track_external(model, opt)
    else:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        tracker = FSDPMemTracker(model, opt)
    with tracker:
        step()
        step()
    print("peak", tracker.get_tracker_snapshot("peak")[dev]["Total"])
    if os.environ.get("SHOW"):
        print(tracker.get_tracker_snapshot("peak")[dev])
else:
    torch.cuda.reset_peak_memory_stats()
    step()
    step()
    print("peak", torch.cuda.max_memory_allocated())
dist.destroy_process_group()
