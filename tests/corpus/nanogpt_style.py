"""nanoGPT-style training: a GPT with tied embedding/LM head built on the CPU, the optimizer
built before the move (as nanoGPT's configure_optimizers does after model.to), bf16 autocast,
GradScaler, gradient clipping, a loss logged every step and an evaluation under no_grad."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=2000, ctx=128, d=128, heads=4, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def build():
    torch.manual_seed(0)
    return GPT()


if __name__ == "__main__":
    model = build()
    print("params", sum(p.numel() for p in model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95))
    model.to("cuda")
    print("after_move", torch.cuda.memory_allocated())
    scaler = torch.amp.GradScaler("cuda", enabled=True)
    data = torch.randint(0, 2000, (10_000,))
    best = math.inf
    for it in range(4):
        ix = torch.randint(len(data) - 65, (4,))
        x = torch.stack([data[i:i + 64] for i in ix]).pin_memory().to("cuda", non_blocking=True)
        y = torch.stack([data[i + 1:i + 65] for i in ix]).pin_memory().to("cuda", non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        lossf = loss.item()
        print(f"iter {it}: loss {lossf:.4f}")
        if it % 2 == 0:
            with torch.no_grad():
                _, val = model(x, y)
            best = min(best, val.item())
    print("state", len(opt.state))
    print("peak", torch.cuda.max_memory_allocated())
    print("done")
