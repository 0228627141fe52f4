"""A small GPT training loop in plain PyTorch: the script the README's ``vram run`` commands use.

Run it under vram (no GPU needed)::

    vram run --gpu 24GiB examples/train.py --batch-size 8
    vram run --gpu T4 examples/train.py --batch-size 64      # runs out of memory on a 16 GB card

It builds GPT-2 small (`mymodels.gpt2_small`, 124 M parameters), then runs ``--steps`` AdamW steps
under bf16 autocast on random token ids, printing ``torch.cuda.max_memory_allocated()`` at the end.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mymodels import gpt2_small  # noqa: E402  (the example models next to this file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    model = gpt2_small().to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for step in range(args.steps):
        x = torch.randint(0, 50257, (args.batch_size, args.seq_len), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step}: max allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
