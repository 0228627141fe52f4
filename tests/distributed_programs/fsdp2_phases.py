"""FSDP2 on two bias-free 1024x1024 linears: memory after sharding, through the forward, and
which streams hold the collectives' memory. Prints ``name allocated peak`` lines (bytes over a
warmed-up baseline) and, at the end, the reserved bytes per stream FSDP2 uses."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from memlog import show, warm_up
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

p = argparse.ArgumentParser()
p.add_argument("--no-reshard", action="store_true")
p.add_argument("--prefetch", action="store_true", help="layer 0 prefetches layer 1 in forward")
p.add_argument("--offload", action="store_true", help="CPUOffloadPolicy")
a = p.parse_args()

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
pre = warm_up()


model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False)).cuda()
torch.cuda.reset_peak_memory_stats()
show("built")
policy = CPUOffloadPolicy() if a.offload else OffloadPolicy()
for layer in model:
    fully_shard(layer, reshard_after_forward=not a.no_reshard, offload_policy=policy)
fully_shard(model, reshard_after_forward=not a.no_reshard, offload_policy=policy)
if a.prefetch:
    model[0].set_modules_to_forward_prefetch([model[1]])
show("sharded")
model[0].register_forward_pre_hook(lambda m, args: print("layer0", torch.cuda.memory_allocated() - pre))
x = torch.randn(8, 1024, device="cuda")
y = model(x)
show("forward")
y.sum().backward()
show("backward")
ctx = model._get_fsdp_state()._comm_ctx
names = {ctx.all_gather_copy_in_stream.cuda_stream: "all_gather_copy_in", 0: "default",
         ctx.all_gather_stream.cuda_stream: "all_gather", ctx.reduce_scatter_stream.cuda_stream: "reduce_scatter"}
per_stream = {}
for seg in torch.cuda.memory_snapshot():
    name = names.get(seg["stream"], hex(seg["stream"]))
    per_stream[name] = per_stream.get(name, 0) + seg["total_size"]
print("streams", sorted(per_stream.items()))
dist.destroy_process_group()
