import torch
import torch.nn.functional as F
class Block(torch.nn.Module):
    def __init__(s, d=256, h=4):
        super().__init__(); s.h = h; s.qkv = torch.nn.Linear(d, 3*d); s.o = torch.nn.Linear(d, d); s.ln = torch.nn.LayerNorm(d)
    def forward(s, x):
        B, T, C = x.shape
        q, k, v = s.qkv(s.ln(x)).split(C, dim=2)
        q = q.view(B, T, s.h, C // s.h).transpose(1, 2)
        k = k.view(B, T, s.h, C // s.h).transpose(1, 2)
        v = v.view(B, T, s.h, C // s.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + s.o(y.transpose(1, 2).contiguous().view(B, T, C))
m = torch.nn.Sequential(Block(), Block()).cuda()
c = torch.compile(m)
with torch.autocast('cuda', dtype=torch.bfloat16):
    for T in (128, 96, 64):
        x = torch.randn(8, T, 256, device='cuda')
        out = c(x)
        out.float().sum().backward()
        print(T, torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated())
