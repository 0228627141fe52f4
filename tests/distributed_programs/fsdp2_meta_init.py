"""The way torchtitan builds an FSDP2 model (torchtitan/train.py): on the meta device,
``fully_shard`` per block and at the root, ``to_empty(device="cuda")``, then ``init_weights``
(``nn.init.trunc_normal_`` on DTensor parameters: DTensor's RNG tracker copies
``torch.cuda.get_rng_state()`` to the GPU, and torch 2.13's rejection sampling redraws until no
value is out of bounds), a step with ``clip_grad_norm_(foreach=True)``, and the peak reset each
step as torchtitan's metrics do. Prints ``name bytes`` lines."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
with torch.device("meta"):
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False))
for block in model:
    fully_shard(block)
fully_shard(model)
model.to_empty(device="cuda")
print("to_empty", torch.cuda.memory_allocated())
with torch.no_grad():
    for p in model.parameters():
        nn.init.trunc_normal_(p, std=0.02, a=-0.06, b=0.06)
print("init", torch.cuda.memory_allocated())
opt = torch.optim.AdamW(model.parameters(), foreach=True)
for _ in range(2):
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    opt.zero_grad()
    print("step_peak", torch.cuda.max_memory_allocated())
    torch.cuda.reset_peak_memory_stats()
dist.destroy_process_group()
