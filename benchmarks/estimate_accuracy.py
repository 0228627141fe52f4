"""Ground truth for vram's predictions: the same training steps on a real CUDA GPU and on vram.

    python3 benchmarks/estimate_accuracy.py            # comparison table
    python3 benchmarks/estimate_accuracy.py --json     # one JSON object
    python3 benchmarks/estimate_accuracy.py --models mlp gpt --steps 3

For each model (an MLP, a small GPT with scaled-dot-product attention, a small CNN), with and
without bf16 autocast, a few Adam training steps run twice, each in its own subprocess:

* **real**: on ``cuda:0`` as is; records ``torch.cuda.max_memory_allocated()``,
  ``max_memory_reserved()``, ``memory_stats()``, and the device's name, capability, SM count,
  total memory and the CUDA context's size (total − free − reserved after CUDA initialisation);
* **vram**: the identical code under ``vram.run.runtime.simulated_cuda`` configured as that device
  (same total memory, context, name, compute capability, SM count, ``PYTORCH_CUDA_ALLOC_CONF``).

The two halves never share a process: ``simulated_cuda`` patches ``torch.cuda``, and the real run
must see the real one. The parent process only asks ``torch.cuda.is_available()``; without a GPU it
prints "no CUDA GPU available: ground-truth comparison skipped" and exits 0.

Known sources of difference (docs/estimate-accuracy.md): cuDNN workspaces of convolutions,
kernel-internal scratch (cuBLAS copies of oddly strided operands,
memory-efficient attention's backward workspace), cuDNN attention on builds that prefer it,
and library versions whose rules differ from those vram models (torch 2.13).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
SKIP_MESSAGE = "no CUDA GPU available: ground-truth comparison skipped"
MODELS = ("mlp", "gpt", "cnn")
KEYS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "active_bytes.all.peak",
        "requested_bytes.all.peak", "segment.all.peak", "allocation.all.allocated",
        "num_alloc_retries", "num_ooms")


# -- the workloads (imported by both workers; nothing here touches vram) --------------------------
def _build(name: str, device: str) -> tuple[Any, Any, Any]:
    """(model, inputs, targets) on `device`, seeded."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                              nn.Linear(4096, 1024), nn.GELU(), nn.Linear(1024, 10))
        x = torch.randn(4096, 1024, device=device)
        y = torch.randint(0, 10, (4096,), device=device)
    elif name == "gpt":  # nanoGPT's GPT, as bench_estimate.py writes it: 6 layers, d 512, vocab 8192
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_estimate import GPT

        model = GPT(vocab=8192, n_ctx=512, d=512, heads=8, layers=6)
        x = torch.randint(0, 8192, (8, 512), device=device)
        y = torch.randint(0, 8192, (8, 512), device=device)
    elif name == "cnn":
        def stage(cin: int, cout: int) -> list[Any]:
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

        model = nn.Sequential(*stage(3, 64), nn.MaxPool2d(2), *stage(64, 128), nn.MaxPool2d(2),
                              *stage(128, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 100))
        x = torch.randn(64, 3, 128, 128, device=device)
        y = torch.randint(0, 100, (64,), device=device)
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.to(device), x, y


def _train(name: str, autocast: bool, steps: int) -> None:
    """`steps` Adam steps of model `name` on cuda:0 (real or simulated)."""
    import torch
    import torch.nn.functional as F

    model, x, y = _build(name, "cuda")
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)  # (batch, classes), or (batch, seq, vocab) for the GPT: flattened views
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del loss


def _stats() -> dict[str, Any]:
    import torch

    stats = {k: int(v) for k, v in torch.cuda.memory_stats().items() if isinstance(v, (int, float))}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "memory_stats": stats}


# -- the two workers (each in its own process) ----------------------------------------------------
def _worker_real(name: str, autocast: bool, steps: int) -> dict[str, Any]:
    import torch

    torch.backends.cudnn.benchmark = False
    torch.cuda.init()
    torch.empty(0, device="cuda")  # create the context
    free, total = torch.cuda.mem_get_info()
    props = torch.cuda.get_device_properties(0)
    device = {"name": props.name, "major": props.major, "minor": props.minor,
              "multi_processor_count": props.multi_processor_count, "total_memory": total,
              "context": total - free - torch.cuda.memory_reserved(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    torch.cuda.reset_peak_memory_stats()
    _train(name, autocast, steps)
    torch.cuda.synchronize()
    return {"device": device, **_stats()}


def _worker_vram(name: str, autocast: bool, steps: int, device: dict[str, Any]) -> dict[str, Any]:
    if SRC not in sys.path:
        sys.path.insert(0, SRC)
    import torch

    from vram.run.runtime import simulated_cuda

    with simulated_cuda(gpu=device["total_memory"], context=device["context"],
                        conf=device.get("alloc_conf") or "", name=device["name"],
                        major=device["major"], minor=device["minor"],
                        multi_processor_count=device["multi_processor_count"]):
        torch.cuda.reset_peak_memory_stats()
        _train(name, autocast, steps)
        return _stats()


def _run_worker(args: list[str], env_src: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if env_src:
        env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- the comparison ------------------------------------------------------------------------------
def _pct(real: int, sim: int) -> float | None:
    return None if not real else round(100.0 * (sim - real) / real, 3)


def compare(models: list[str], steps: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = []
    device: dict[str, Any] | None = None
    for name in models:
        for autocast in (False, True):
            label = f"{name}{' +bf16 autocast' if autocast else ''}"
            common = ["--model", name, "--steps", str(steps)] + (["--autocast"] if autocast else [])
            real = _run_worker(["--_worker", "real", *common], env_src=False)
            row: dict[str, Any] = {"model": label, "real": real}
            if "error" not in real:
                device = real["device"]
                sim = _run_worker(["--_worker", "vram", "--device", json.dumps(device), *common], env_src=True)
                row["vram"] = sim
                if "error" not in sim:
                    row["diff"] = {
                        key: {"real": real[key], "vram": sim[key], "bytes": sim[key] - real[key],
                              "percent": _pct(real[key], sim[key])}
                        for key in ("max_memory_allocated", "max_memory_reserved")}
                    row["stats_diff"] = {
                        k: {"real": real["memory_stats"].get(k), "vram": sim["memory_stats"].get(k)}
                        for k in KEYS}
            results.append(row)
    return {"device": device, "steps": steps, "results": results}


def _table(report: dict[str, Any]) -> str:
    dev = report["device"] or {}
    lines = [f"device: {dev.get('name')} sm{dev.get('major')}{dev.get('minor')}, "
             f"{dev.get('total_memory', 0) / 2**30:.1f} GiB, context {dev.get('context', 0) / 2**20:.0f} MiB, "
             f"torch {dev.get('torch')} (CUDA {dev.get('cuda')}); {report['steps']} Adam steps each", ""]
    head = (f"| {'model':<20} | {'real peak alloc':>16} | {'vram peak alloc':>16} | {'diff':>12} | {'%':>8} "
            f"| {'real peak reserved':>18} | {'vram peak reserved':>18} | {'diff':>12} | {'%':>8} |")
    lines += [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for row in report["results"]:
        if "diff" not in row:
            err = (row.get("vram") or row["real"]).get("error")
            lines.append(f"| {row['model']:<20} | error: {err} |")
            continue
        a, r = row["diff"]["max_memory_allocated"], row["diff"]["max_memory_reserved"]
        fmt = lambda p: "n/a" if p is None else f"{p:+.2f}"  # noqa: E731
        lines.append(f"| {row['model']:<20} | {a['real']:>16,} | {a['vram']:>16,} | {a['bytes']:>+12,} "
                     f"| {fmt(a['percent']):>8} "
                     f"| {r['real']:>18,} | {r['vram']:>18,} | {r['bytes']:>+12,} | {fmt(r['percent']):>8} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--_worker", choices=("real", "vram"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--autocast", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args._worker == "real":
        print(json.dumps(_worker_real(args.model, args.autocast, args.steps)))
        return 0
    if args._worker == "vram":
        print(json.dumps(_worker_vram(args.model, args.autocast, args.steps, json.loads(args.device))))
        return 0

    import torch  # the parent only asks whether there is a GPU; it never patches torch.cuda

    if not torch.cuda.is_available():
        print(SKIP_MESSAGE)  # with or without --json: nothing was measured
        return 0
    report = compare(args.models, args.steps)
    print(json.dumps(report) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
