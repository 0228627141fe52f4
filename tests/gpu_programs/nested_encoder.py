"""nn.TransformerEncoder's nested-tensor fast path (eval, padding mask, fp32 then fp16) on a batch
of variable-length sequences, and jagged nested tensors into SDPA forward and backward (bf16)."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
enc = torch.nn.TransformerEncoder(layer, 6).cuda().eval()
lengths = torch.randint(16, 256, (32,))
pad = torch.arange(256)[None, :] >= lengths[:, None]
x = torch.randn(32, 256, 512, device="cuda")
with torch.no_grad():
    out = enc(x, src_key_padding_mask=pad.cuda())
    print("fp32", out.shape, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    enc.half()
    out = enc(x.half(), src_key_padding_mask=pad.cuda())
    print("fp16", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
del out, enc
seqs = [torch.randn(int(n), 8, 64, device="cuda", dtype=torch.bfloat16) for n in lengths[:16]]
q = torch.nested.nested_tensor(seqs, layout=torch.jagged, requires_grad=True)
y = F.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))
y.values().float().sum().backward()
print("end", torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
