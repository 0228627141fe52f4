"""The graphs Dynamo compiles of ``tiny_stack.stack`` under FSDP2 with each block checkpointed,
on the CPU with PyTorch's fake process group (rank 0 of 2), ``torch.compile`` with a backend that
records each graph's call_function targets: ``wrapper`` (``checkpoint_wrapper`` around each block
before ``fully_shard``, as `vram.estimate.trace.wrap_checkpointed` wraps them) or ``partial``
(each block's forward replaced by ``functools.partial(checkpoint, forward, use_reentrant=False)``
after ``fully_shard``). Prints the graphs as JSON, each a list of target names."""
import functools
import json
import sys

import torch
import torch.distributed as dist
from tiny_stack import stack
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed import fake_pg  # noqa: F401  registers backend "fake"
from torch.utils.checkpoint import checkpoint

way = sys.argv[1]
dist.init_process_group("fake", rank=0, world_size=2)
m = stack()
if way == "wrapper":
    for i, block in enumerate(m.blocks):
        m.blocks[i] = checkpoint_wrapper(block)
mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
for block in m.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(m, mesh=mesh)
if way == "partial":
    for block in m.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
graphs = []


def capture(gm, example_inputs):
    graphs.append([getattr(n.target, "__name__", type(n.target).__name__) for n in gm.graph.nodes
                   if n.op == "call_function"])
    return gm.forward


torch.compile(m, backend=capture)(torch.randn(8, 256)).sum().backward()
print(json.dumps(graphs))
dist.destroy_process_group()
