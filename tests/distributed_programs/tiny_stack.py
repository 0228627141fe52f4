"""A stack of MLP blocks in a top-level ModuleList: the factory `vram estimate` tests shard, replicate and split."""
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d)
    def forward(self, x):
        return self.down(self.act(self.up(x)))
class NormBlock(Block):
    """A pre-norm residual block: x + down(relu(up(norm(x))))."""
    def __init__(self, d=256):
        super().__init__(d)
        self.norm = nn.LayerNorm(d)
    def forward(self, x):
        return x + super().forward(self.norm(x))
class Stack(nn.Module):
    def __init__(self, d=256, n=4, block=Block):
        super().__init__()
        self.blocks = nn.ModuleList(block(d) for _ in range(n))
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
def stack():
    return Stack()


def flat():
    """Two Linears in an nn.Sequential: no ModuleList to split into pipeline stages."""
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))


def tp_plan(model, tp_mesh):
    """Megatron-style tensor parallel for `stack`: each block's up column-wise, down row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def norm_stack():
    """`stack` with pre-norm residual blocks (`NormBlock`), for sequence parallel."""
    return Stack(block=NormBlock)


def sp_plan(model, tp_mesh):
    """Megatron-style tensor + sequence parallel for `norm_stack` (torchtitan's pattern): the norm
    on the local sequence shard (SequenceParallel, dim 1), up column-wise from the all-gathered
    sequence, down row-wise reduce-scattered back to sequence shards."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
                                            "down": RowwiseParallel(output_layouts=Shard(1))})
