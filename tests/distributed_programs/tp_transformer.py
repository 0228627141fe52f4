"""Tensor + sequence parallel training step of a small Llama-style transformer through DTensor,
with torchtitan's plan (``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``):
embeddings row-wise to ``Shard(1)``, norms ``SequenceParallel``, attention and feed-forward
inputs ``PrepareModuleInput(Shard(1) -> Replicate())``, q/k/v and w1/w3 column-wise, wo and w2
row-wise to ``Shard(1)``, the output projection column-wise from ``Shard(1)``.

Under ``vram run --nproc-per-node N`` it prints, per rank, ``local NAME SHAPE`` for the sharded
weights and ``peak N``: ``max_memory_allocated()`` over a warmed-up baseline for one forward,
backward and AdamW step. With ``--tracker`` it is rank 0 of 2 on the CPU with PyTorch's fake
process group under ``torch.distributed._tools.mem_tracker.MemTracker`` and prints the
tracker's peak "Total"; ``end N`` is what stays allocated after the step. ``--checkpoint``
wraps each block in ``checkpoint_wrapper`` (non-reentrant activation checkpointing)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

p = argparse.ArgumentParser()
p.add_argument("--tracker", action="store_true", help="MemTracker on CPU with a fake process group")
p.add_argument("--checkpoint", action="store_true")
p.add_argument("--fsdp", type=int, default=1, help="a 2-D mesh: FSDP2 over this many ranks x TP")
a = p.parse_args()

if a.tracker:  # as PyTorch's test/distributed/_tools/test_mem_tracker.py, on the CPU
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers backend "fake"
    from torch.distributed._tools import mem_tracker

    # MemTracker rounds storages to 512 bytes on CUDA only (_WeakRefInfo); the CPU run does too
    mem_tracker._WeakRefInfo._calculate_mem_consumed = lambda info: -(-info.size * info.element_size // 512) * 512
    dist.init_process_group("fake", rank=0, world_size=2 * a.fsdp)
    dev = torch.device("cpu")
    mesh2d = init_device_mesh("cpu", (a.fsdp, 2), mesh_dim_names=("dp", "tp"))
else:
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    mesh2d = init_device_mesh("cuda", (a.fsdp, int(os.environ["WORLD_SIZE"]) // a.fsdp), mesh_dim_names=("dp", "tp"))
    warm = nn.Linear(768, 768, device=dev)           # cuBLAS workspaces first, outside the figure
    warm(torch.randn(2, 768, device=dev)).sum().backward()
    del warm
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pre = torch.cuda.memory_allocated()

mesh = mesh2d["tp"]
DIM, HEADS, LAYERS, VOCAB, BATCH, SEQ = 256, 8, 2, 1024, 4, 128


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        hd = DIM // HEADS
        q, k, v = (w(x).view(b, s, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = (q @ k.transpose(-2, -1)) * hd ** -0.5   # local heads: the column-wise shard
        out = att.softmax(-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 4 * DIM, bias=False), nn.Linear(DIM, 4 * DIM, bias=False)
        self.w2 = nn.Linear(4 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


torch.manual_seed(0)
model = Transformer().to(dev)
parallelize_module(model, mesh, {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
})
for i, block in enumerate(model.layers):
    parallelize_module(block, mesh, {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    })
    if a.checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
if a.fsdp > 1:
    from torch.distributed.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block, mesh=mesh2d["dp"])
    fully_shard(model, mesh=mesh2d["dp"])
if not a.tracker:
    for name in ("tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.feed_forward.w2.weight",
                 "output.weight", "norm.weight"):
        w = model.get_parameter(name.replace("layers.0.", "layers.0._checkpoint_wrapped_module.")
                                if a.checkpoint else name)
        print("local", name, tuple(w.to_local().shape))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
tokens = torch.randint(0, VOCAB, (BATCH, SEQ), device=dev)
labels = torch.randint(0, VOCAB, (BATCH, SEQ), device=dev)


def step():
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()


if a.tracker:
    if a.fsdp > 1:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        mt = FSDPMemTracker(model, optim)
        mt.track_inputs((tokens,))
    else:
        mt = mem_tracker.MemTracker()
        mt.track_external(model, optim)
    with mt:
        step()
    print("peak", mt.get_tracker_snapshot("peak")[dev]["Total"])
    print("end", mt.get_tracker_snapshot()[dev]["Total"])
else:
    step()
    print("peak", torch.cuda.max_memory_allocated() - pre)
    print("end", torch.cuda.memory_allocated() - pre)
dist.destroy_process_group()
