"""Two FSDP1 (``FullyShardedDataParallel``, FlatParameters) training steps of an MLP stack; prints
the peak memory over a warmed-up baseline.

Run under torchrun (or ``vram run --nproc-per-node 2``) it reads ``torch.cuda.max_memory_allocated``;
with ``--tracker`` it runs rank 0 of 2 on the CPU with PyTorch's fake process group under
``torch.distributed._tools.mem_tracker.MemTracker`` (FSDPMemTracker is FSDP2 only), resetting
the module statistics after the first step as PyTorch's test_mem_tracker.py does, and prints
the tracker's peak "Total"."""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from memlog import start
from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

p = argparse.ArgumentParser()
p.add_argument("--tracker", action="store_true", help="MemTracker on CPU with a fake process group")
p.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
p.add_argument("--orig", action="store_true", help="use_orig_params=True")
p.add_argument("--bf16", action="store_true", help="MixedPrecision(param_dtype=bfloat16)")
p.add_argument("--wrap", action="store_true", help="one FSDP unit per block (ModuleWrapPolicy)")
p.add_argument("--no-limit", action="store_true", help="limit_all_gathers=False")
p.add_argument("--backward-prefetch", default="BACKWARD_PRE", choices=["BACKWARD_PRE", "BACKWARD_POST", "NONE"])
p.add_argument("--forward-prefetch", action="store_true")
a = p.parse_args()

dev, pre = start(a.tracker)  # cuBLAS workspaces first, kept out of the figure
if a.tracker:
    from torch.distributed._tools.mem_tracker import MemTracker
    if a.orig:  # use_orig_params: the module's parameters are views of the FlatParameter, on which
        # MemTracker's grad-category hook fails ("post accumulate grad hooks cannot be registered
        # on non-leaf tensors"); it only labels storages, the Total counts each storage anyway
        _hook = torch.Tensor.register_post_accumulate_grad_hook
        torch.Tensor.register_post_accumulate_grad_hook = (
            lambda t, fn: _hook(t, fn) if t.is_leaf else t.register_hook(lambda g: None))
torch.manual_seed(42)
dim, bsz = 256, 64
model = nn.Sequential(*[nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
                        for _ in range(3)]).to(dev)
mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if a.bf16 else None
prefetch = None if a.backward_prefetch == "NONE" else BackwardPrefetch[a.backward_prefetch]
model = FSDP(model, sharding_strategy=ShardingStrategy[a.strategy], use_orig_params=a.orig, mixed_precision=mp,
             auto_wrap_policy=ModuleWrapPolicy({type(model[0])}) if a.wrap else None, device_id=dev,
             limit_all_gathers=not a.no_limit, backward_prefetch=prefetch, forward_prefetch=a.forward_prefetch)
optim = torch.optim.Adam(model.parameters(), lr=1e-2)
inp = torch.randn(bsz, dim, device=dev)


def step():
    model(inp).sum().backward()
    optim.step()
    optim.zero_grad()


if a.tracker:
    mt = MemTracker()
    mt.track_external(model, optim, inp)
    with mt:
        for i in range(2):
            step()
            if i == 0:
                mt.reset_mod_stats()
    print("peak", mt.get_tracker_snapshot("peak")[dev]["Total"])
else:
    for _ in range(2):
        step()
    print("peak", torch.cuda.max_memory_allocated() - pre)
dist.destroy_process_group()
