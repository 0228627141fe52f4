"""An 8-rank FSDP2 training step of a Llama-3-8B-shaped model under ``vram run``.

Run: ``python3 benchmarks/bench_distributed.py`` (``--ac full|none``, ``--batch``, ``--seq``,
``--steps``, ``--all-ranks`` to simulate all 8 ranks as well as one; needs torch).

The script (written to a temporary file) is an ordinary FSDP2 program: the model is built on the
meta device (Llama 3 8B's shape, as torchtitan's ``llama3_8b`` flavour: dim 4096, 32 layers, 32
heads, 8 KV heads, FFN 14336, vocab 128256), ``fully_shard`` per block and at the root with a
bf16 ``MixedPrecisionPolicy`` (float32 reduce), ``to_empty(device="cuda")``, AdamW, and
``--steps`` training steps on random token ids. Every rank runs the same program on an equal shard
(8.03 B parameters divide evenly by 8 per tensor dimension 0), so ``--ranks 0`` simulates one rank
and stands for all eight; ``--all-ranks`` also runs all eight (``--jobs`` = the machine's cores)
to show that they agree and what it costs.

Printed per run: wall time of the whole ``vram run`` (Python and torch start-up included), the
largest host RSS of one rank process (``RUSAGE_CHILDREN``'s ``ru_maxrss``: the biggest waited-for
descendant), and vram's per-rank table (peak allocated, peak reserved).
"""
from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = '''
import argparse, time
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

p = argparse.ArgumentParser()
p.add_argument("--ac", default="full")
p.add_argument("--batch", type=int, default=1)
p.add_argument("--seq", type=int, default=8192)
p.add_argument("--steps", type=int, default=2)
a = p.parse_args()
DIM, LAYERS, HEADS, KV, FFN, VOCAB = 4096, 32, 32, 8, 14336, 128256
HD = DIM // HEADS


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HD, bias=False)
        self.wk = nn.Linear(DIM, KV * HD, bias=False)
        self.wv = nn.Linear(DIM, KV * HD, bias=False)
        self.wo = nn.Linear(HEADS * HD, DIM, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, HEADS, HD)
        k = self.wk(x).view(b, s, KV, HD)
        v = self.wv(x).view(b, s, KV, HD)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k = k.repeat_interleave(HEADS // KV, dim=2)
        v = v.repeat_interleave(HEADS // KV, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, DIM))


def rope(x, cos, sin):
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5), nn.RMSNorm(DIM, eps=1e-5)
        self.attention = Attention()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        f = 1.0 / (500000.0 ** (torch.arange(0, HD, 2, device=tokens.device).float() / HD))
        ang = torch.outer(torch.arange(s, device=tokens.device).float(), f)
        cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


dist.init_process_group("nccl")
torch.cuda.set_device(int(__import__("os").environ["LOCAL_RANK"]))
t0 = time.perf_counter()
with torch.device("meta"):
    model = Llama()
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for i, block in enumerate(model.layers):
    if a.ac == "full":
        block = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[i] = block
    fully_shard(block, mp_policy=mp)
fully_shard(model, mp_policy=mp)
model.to_empty(device="cuda")
for prm in model.parameters():
    nn.init.normal_(prm, std=0.02)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
t1 = time.perf_counter()
for _ in range(a.steps):
    tokens = torch.randint(0, VOCAB, (a.batch, a.seq + 1), device="cuda")
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
n = sum(p.numel() for p in model.parameters())
print(f"params {n} build {t1 - t0:.1f}s steps {time.perf_counter() - t1:.1f}s "
      f"max_reserved {torch.cuda.max_memory_reserved()} max_allocated {torch.cuda.max_memory_allocated()}")
dist.destroy_process_group()
'''


def run(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, the largest child RSS so far (KiB), stdout; exits on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ac", choices=["full", "none"], default="full")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--gpu", default="H100")
    ap.add_argument("--all-ranks", action="store_true", help="also simulate all 8 ranks")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_dist_") as tmp:
        step = Path(tmp) / "llama3_8b_fsdp2.py"
        step.write_text(STEP)
        base = [sys.executable, "-m", "vram", "run", "--gpu", args.gpu, "--nproc-per-node", "8"]
        sargs = [str(step), "--ac", args.ac, "--batch", str(args.batch), "--seq", str(args.seq),
                 "--steps", str(args.steps)]
        print(f"Llama-3-8B shape, FSDP2 x 8, bf16 params / fp32 reduce, AdamW, AC {args.ac}, "
              f"batch {args.batch} x seq {args.seq}, {args.steps} step(s), --gpu {args.gpu}, {os.cpu_count()} cores")
        for label, ranks in [("--ranks 0 (one rank stands for all 8)", ["--ranks", "0"])] + \
                ([("all 8 ranks", [])] if args.all_ranks else []):
            wall, rss, out = run(base + ranks + sargs)
            print(f"\n{label}: wall {wall:.1f} s, largest rank process RSS {rss / 1024:.0f} MiB")
            for line in out.splitlines():
                if re.match(r"^\[rank\d+\]:params|^ *rank |^ *\d+ +\d+ +cuda:", line):
                    print("  " + line)


if __name__ == "__main__":
    main()
