"""A top-p (nucleus) sampling loop over a small causal LM: sort, cumsum, masked_fill, softmax,
multinomial, a growing sequence (no KV cache), in bf16 autocast under no_grad."""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
V, D, L = 8192, 512, 4
emb = torch.nn.Embedding(V, D).cuda()
layer = torch.nn.TransformerEncoderLayer(D, 8, 4 * D, batch_first=True, norm_first=True)
body = torch.nn.TransformerEncoder(layer, L).cuda().eval()
head = torch.nn.Linear(D, V, bias=False).cuda()
ids = torch.randint(0, V, (4, 16), device="cuda")
with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    for _ in range(32):
        T = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(T, device="cuda")
        logits = head(body(emb(ids), mask=mask, is_causal=True))[:, -1, :].float()
        probs = F.softmax(logits / 0.8, dim=-1)
        sp, si = torch.sort(probs, descending=True)
        cum = torch.cumsum(sp, dim=-1)
        sp[(cum - sp) > 0.9] = 0.0
        nxt = si.gather(-1, torch.multinomial(sp / sp.sum(-1, keepdim=True), 1))
        ids = torch.cat([ids, nxt], dim=1)
print("end", ids.shape, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
