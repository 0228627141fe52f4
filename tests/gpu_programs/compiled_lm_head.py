"""A compiled GPT-2-vocabulary language-model head's training step: embedding (50257 x 768),
LayerNorm, the tied LM head (768 -> 50257, an unaligned n for pad_mm) and cross entropy, under
bf16 autocast then in fp32, 3 steps each with AdamW, on an empty Inductor cache (a first run).
Prints each step's peaks and, on a GPU, pad_mm's decisions (``PADMM`` JSON lines, as
pad_mm_decisions.py) for the padded-or-not comparison with ``vram run --gpu H200``."""
import json
import os
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="lm_head_inductor_"))

import torch  # noqa: E402
from pad_mm_decisions import DECISIONS, watch_pad_mm  # noqa: E402 - this folder's program (sys.path[0])


class Head(torch.nn.Module):
    def __init__(self, vocab=50257, dim=768):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.ln = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx, targets):
        logits = self.head(self.ln(self.wte(idx)))
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def run(label, autocast):
    torch.manual_seed(0)
    model = Head().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = torch.compile(model)
    idx = torch.randint(0, 50257, (8, 1024), device="cuda")
    targets = torch.randint(0, 50257, (8, 1024), device="cuda")
    for i in range(3):
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = step(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(label, "step", i, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(), flush=True)
    del model, opt, step
    torch.cuda.empty_cache()


def main():
    try:
        watch_pad_mm()
    except Exception as e:  # under vram run the compile happens in its own process
        print("pad_mm not watched here:", e, file=sys.stderr)
    for label, autocast in (("bf16", True), ("fp32", False)):
        DECISIONS.clear()
        torch._dynamo.reset()
        run(label, autocast)
        print("PADMM", json.dumps({"kind": "lm_head", "label": label, "decisions": DECISIONS}, default=str), flush=True)


if __name__ == "__main__":
    main()
