"""Two FSDP2 training steps of an MLP stack; prints the peak memory over a warmed-up baseline, as
PyTorch's test/distributed/_tools/test_fsdp2_mem_tracker.py measures it.

Run under torchrun (or ``vram run --nproc-per-node 2``) it reads ``torch.cuda.max_memory_allocated``;
with ``--tracker`` it runs rank 0 of 2 on the CPU with PyTorch's fake process group under
``FSDPMemTracker`` and prints the tracker's peak "Total"."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from memlog import start
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

p = argparse.ArgumentParser()
p.add_argument("--tracker", action="store_true", help="FSDPMemTracker on CPU with a fake process group")
p.add_argument("--no-reshard", action="store_true")
p.add_argument("--bf16", action="store_true")
p.add_argument("--foreach", action="store_true")
p.add_argument("--ac", action="store_true", help="activation checkpointing of every block (composable)")
a = p.parse_args()

dev, pre = start(a.tracker)  # cuBLAS workspaces first, kept out of the figure (test_fsdp2_mem_tracker.py)
if a.tracker:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
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
