"""A DDP step whose backward takes in-place formulas on a GPU (tests/test_subclass_formulas.py's
families): prints how many gradient-sized blocks the backward allocates and the step's peak.
``--single``: the same model and step on one GPU without DDP."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

N, M = 48, 40
FULL = N * M * 4


class Families(nn.Module):
    """x.exp() feeds sin and cos (gradient accumulation), max over a dim, gather and indexing."""

    def __init__(self):
        super().__init__()
        self.x = nn.Parameter(torch.randn(N, M))

    def forward(self, ids):
        y = self.x.exp()
        return ((y.sin() + y.cos()).sum() + self.x.max(dim=1).values.sum()
                + self.x.gather(1, ids[:, :2]).sum() + self.x[ids[:2, 0]].sum())


single = "--single" in sys.argv
local = int(os.environ.get("LOCAL_RANK", 0))
torch.cuda.set_device(local)
model = Families().cuda()
if not single:
    dist.init_process_group("nccl")
    model = nn.parallel.DistributedDataParallel(model, device_ids=[local])
ids = torch.zeros(N, 2, dtype=torch.long, device="cuda")
loss = model(ids)
torch.cuda.memory._record_memory_history()
loss.backward()
trace = torch.cuda.memory._snapshot()["device_traces"][local]
torch.cuda.memory._record_memory_history(enabled=None)
print("full", sum(1 for e in trace if e["action"] == "alloc" and e["size"] == FULL))
print("peak", torch.cuda.max_memory_allocated())
if not single:
    dist.destroy_process_group()
