"""Two FSDP2 training steps of an MLP stack; prints the peak memory over a warmed-up baseline, as
PyTorch's test/distributed/_tools/test_fsdp2_mem_tracker.py measures it.

Run under torchrun (or ``vram run --nproc-per-node 2``) it reads ``torch.cuda.max_memory_allocated``;
with ``--tracker`` it runs rank 0 of 2 on the CPU with PyTorch's fake process group under
``FSDPMemTracker`` and prints the tracker's peak "Total"."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

p = argparse.ArgumentParser()
p.add_argument("--tracker", action="store_true", help="FSDPMemTracker on CPU with a fake process group")
p.add_argument("--no-reshard", action="store_true")
p.add_argument("--bf16", action="store_true")
p.add_argument("--foreach", action="store_true")
p.add_argument("--ac", action="store_true", help="activation checkpointing of every block (composable)")
a = p.parse_args()

if a.tracker:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers backend "fake"
    from torch.distributed._tools import mem_tracker
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    def rounded(self):  # the tracker rounds CUDA storages to 512 bytes; do so on the CPU too
        return -(-self.size * self.element_size // 512) * 512
    mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    dev = torch.device("cpu")
    dist.init_process_group("fake", rank=0, world_size=2)
else:
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl")

if not a.tracker:  # cuBLAS workspaces first, kept out of the figure (test_fsdp2_mem_tracker.py)
    lin = nn.Linear(768, 768, device=dev)
    lin(torch.randn(2, 768, device=dev)).sum().backward()  # batch > 1: cuBLASLt's too
    del lin
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pre = torch.cuda.memory_allocated()
torch.manual_seed(42)
dim, bsz = 256, 64
model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
                        for _ in range(3)]).to(dev)
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.bf16 else MixedPrecisionPolicy()
for block in model:
    if a.ac:
        from torch.distributed._composable import checkpoint
        checkpoint(block)
    fully_shard(block, reshard_after_forward=not a.no_reshard, mp_policy=mp)
fully_shard(model, reshard_after_forward=not a.no_reshard, mp_policy=mp)
optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=a.foreach)
inp = torch.randn(bsz, dim, device=dev)


def step():
    loss = model(inp).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()


if a.tracker:
    fmt = FSDPMemTracker(model, optim)
    fmt.track_inputs((inp,))
    with fmt:
        for _ in range(2):
            step()
    print("peak", fmt.get_tracker_snapshot("peak")[dev]["Total"])
else:
    for _ in range(2):
        step()
    print("peak", torch.cuda.max_memory_allocated() - pre)
dist.destroy_process_group()
