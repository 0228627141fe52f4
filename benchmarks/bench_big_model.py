"""A 7B Llama built on the CPU, moved to the simulated GPU, one training step: host time and memory.

The target: under ``vram run``, this script finishes in under a minute and under 2 GiB
of host memory (peak resident set of the ``vram run`` process) on the 2-core CI-sized machine.
Measured 2026-11-24 (torch 2.13 CPU, transformers 5.23): 27.6 s and 0.44 GiB idle, 43.2 s and
0.41 GiB while other jobs loaded the machine; before lazy host tensors, ``--layers 2`` alone took
2.87 GiB and 32 layers could not fit in 24 GiB.

Run: ``python3 benchmarks/bench_big_model.py`` (``--layers N`` for a smaller model, ``--plain``
to also time the same script with plain ``python3`` on a real CPU build, which needs ~4 bytes per
parameter of host memory). Prints one line per run: wall seconds, peak RSS, and the script's own
output (parameter count, ``torch.cuda.max_memory_allocated()``).

The script is what a user writes: Hugging Face ``LlamaForCausalLM`` from a Llama-2-7B config
(hidden 4096, 11,008 intermediate, 32 layers, 32 heads, vocabulary 32,000: 6.74 B parameters),
built on the CPU with its usual initialisation (``nn.Linear``'s Kaiming-uniform, then HF's
``_init_weights`` normal), moved with ``model.to("cuda", dtype=torch.bfloat16)``, AdamW, a batch
of token ids drawn on the CPU with ``torch.randint`` after the model (so the CPU generator's
stream after the model's initialisation is observed), forward + backward + step.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
layers = int(sys.argv[1])
cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                  num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)
print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
model.to("cuda", dtype=torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, cfg.vocab_size, (1, 512))
print(f"first ids: {ids[0, :4].tolist()}")
ids = ids.cuda()
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
opt.step()
opt.zero_grad(set_to_none=True)
print(f"max allocated: {torch.cuda.max_memory_allocated():,} B")
"""


def measured(cmd: list[str]) -> tuple[float, float, str]:
    """Run `cmd` in a fresh wrapper so ``RUSAGE_CHILDREN``'s max RSS is this command's alone."""
    wrapper = ("import resource, subprocess, sys, time\n"
               "t = time.perf_counter(); p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "w = time.perf_counter() - t\n"
               "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20\n"
               "sys.stdout.write(f'{w:.3f} {r:.3f} {p.returncode}\\n' + p.stdout + p.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True)
    head, _, out = proc.stdout.partition("\n")
    wall, rss, rc = head.split()
    if rc != "0":
        raise SystemExit(f"{' '.join(cmd)} failed ({rc}):\n{out}")
    return float(wall), float(rss), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32: Llama-2-7B)")
    ap.add_argument("--gpu", default="H100-80GB")
    ap.add_argument("--plain", action="store_true", help="also run with plain python on the CPU")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "big_llama.py"
        script.write_text(SCRIPT)
        vram = [sys.executable, "-m", "vram", "run", "--gpu", args.gpu, str(script), str(args.layers)]
        env_src = str(Path(__file__).resolve().parents[1] / "src")
        os.environ["PYTHONPATH"] = env_src + os.pathsep + os.environ.get("PYTHONPATH", "")
        print(f"Command: python3 benchmarks/bench_big_model.py --layers {args.layers}")
        wall, rss, out = measured(vram)
        print(f"vram run: {wall:.1f} s, peak RSS {rss:.2f} GiB")
        print("  " + out.strip().replace("\n", "\n  "))
        if args.plain:
            wall, rss, out = measured([sys.executable, "-c",
                                       "import sys, torch; torch.cuda.is_available = lambda: False\n"
                                       + SCRIPT.replace('"cuda"', '"cpu"').replace(".cuda()", "")
                                       .replace("torch.cuda.max_memory_allocated()", "0"),
                                       str(args.layers)])
            print(f"plain python on the CPU: {wall:.1f} s, peak RSS {rss:.2f} GiB")


if __name__ == "__main__":
    main()
