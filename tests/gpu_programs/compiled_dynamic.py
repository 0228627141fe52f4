"""A compiled 2-block causal transformer (bf16 autocast, AdamW) fed three sequence lengths:
Dynamo recompiles with symbolic sizes at the second; 2 steps per length."""
import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, d=512, h=8):
        super().__init__()
        self.h, self.ln1, self.ln2 = h, torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


torch.manual_seed(0)
m = torch.nn.Sequential(Block(), Block()).cuda()
opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
cm = torch.compile(m)
for T in (256, 192, 128):
    for _ in range(2):
        x = torch.randn(8, T, 512, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cm(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    print("T", T, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), flush=True)
