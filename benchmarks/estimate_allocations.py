"""The allocation sequence of five estimates, to compare two versions of the engine exactly.

Run: ``python3 benchmarks/estimate_allocations.py OUT.json`` (writes every ``malloc`` size,
stream, address and every ``free`` of every simulated allocator, in order, for each estimate run
twice in one process: a cold run and a warm one), then ``python3 benchmarks/estimate_allocations.py
--diff A.json B.json`` (exit 1 and the first difference, or "identical"). The estimates: GPT-2
small (8 x 512, AdamW) in fp32, bf16 autocast, bf16 autocast + activation checkpointing; fp16
autocast + SGD at 2 x 128 (GradScaler); a conv / BatchNorm / GroupNorm net with Adam (4 x 3 x 32
x 32). A speed change to the engine must leave every sequence identical. The
engine imported is the one on ``PYTHONPATH`` (``PYTHONPATH=src`` for this tree's).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _conv_net() -> Any:
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3, stride=2),
                         nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))


def _cases() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    import torch

    from mymodels import gpt2_small

    tokens = torch.empty(8, 512, dtype=torch.long, device="meta")
    return {
        "gpt2-fp32": (gpt2_small, tokens, {"optimizer": "adamw"}),
        "gpt2-bf16": (gpt2_small, tokens, {"optimizer": "adamw", "amp": "bf16"}),
        "gpt2-bf16-checkpoint": (gpt2_small, tokens, {"optimizer": "adamw", "amp": "bf16", "checkpoint": True}),
        "gpt2-fp16-sgd-2x128": (gpt2_small, torch.empty(2, 128, dtype=torch.long, device="meta"),
                                {"optimizer": "sgd", "amp": "fp16"}),
        "conv-adam": (_conv_net, torch.empty(4, 3, 32, 32, device="meta"), {"optimizer": "adam"}),
    }


def record() -> dict[str, list[list[Any]]]:
    """{case/run: [["malloc", device, size, stream, address] | ["free", device, address], ...,
    ["figures", ...]]}."""
    import torch

    from vram.allocator import caching
    from vram.estimate.engine import estimate

    torch.set_num_threads(1)
    log: list[list[Any]] = []
    order: dict[int, int] = {}  # allocator -> its number, in order of first use (one per simulated GPU)
    malloc, free = caching.CachingAllocator.malloc, caching.CachingAllocator.free

    def logged_malloc(self: Any, size: Any, stream: Any = 0) -> int:
        ptr = malloc(self, size, stream)
        log.append(["malloc", order.setdefault(id(self), len(order)), size, stream, ptr])
        return ptr

    def logged_free(self: Any, ptr: Any) -> None:
        log.append(["free", order.setdefault(id(self), len(order)), ptr])
        free(self, ptr)

    caching.CachingAllocator.malloc, caching.CachingAllocator.free = logged_malloc, logged_free  # type: ignore[method-assign]
    out: dict[str, list[list[Any]]] = {}
    for name, (model, x, kw) in _cases().items():
        for run in ("cold", "warm"):
            log.clear()
            order.clear()
            r = estimate(model, x, **kw)
            out[f"{name}/{run}"] = [*log, ["figures", r.peak_allocated, r.peak_reserved,
                                           sorted(r.categories.items()), sorted(r.by_module.items())]]
    return out


def diff(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    if a.keys() != b.keys():
        return f"cases differ: {sorted(a)} / {sorted(b)}"
    for k in a:
        if a[k] != b[k]:
            i = next((i for i, (x, y) in enumerate(zip(a[k], b[k])) if x != y), min(len(a[k]), len(b[k])))
            return f"{k}: event {i} of {len(a[k])} / {len(b[k])}: {a[k][i:i + 1]} / {b[k][i:i + 1]}"
    return None


def main() -> None:
    if sys.argv[1:2] == ["--diff"]:
        a, b = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
        found = diff(a, b)
        print(found or "identical: " + ", ".join(f"{k} {len(v)}" for k, v in a.items()))
        sys.exit(1 if found else 0)
    Path(sys.argv[1]).write_text(json.dumps(record()))


if __name__ == "__main__":
    main()
