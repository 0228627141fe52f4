"""`vram.estimate` on one GPU runs on the engine `vram run` uses there (PrivateUse1):
its steady-state peak is the peak a script making the same step reaches under `vram run`, with
the GPU's in-place backward formulas rather than the subclass-safe ones a dispatch mode forces
(docs/estimate-accuracy.md, "Why a simulated backward takes other formulas")."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = pytest.importorskip("torch.nn")
F = pytest.importorskip("torch.nn.functional")

import vram  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch._C, "_acc"), reason="needs torch._C._acc (Python PrivateUse1)")

V, D, L, H, T, B = 50304, 768, 12, 12, 1024, 8  # GPT-2 small, nanoGPT's padded vocabulary


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.qkv, self.o = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2, self.fc, self.proj = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (s.view(b, t, H, c // H).transpose(1, 2) for s in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.o(y)  # residuals: two gradients meet at x (InputBuffer accumulation)
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.Sequential(*(Block() for _ in range(L)))
        self.lnf, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return F.cross_entropy(self.head(self.lnf(self.blocks(x))).view(-1, V), idx.view(-1))


def _script(backend: str) -> tuple[int, int]:
    """The estimate's default step with bf16 autocast and AdamW, written as a script: allocated
    after ``.cuda()``, and the peak of its second iteration."""
    with simulated_cuda(gpu="H100", backend=backend):
        m = GPT().cuda()
        moved = torch.cuda.memory_allocated()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        idx = None
        for it in range(2):
            idx = torch.empty((B, T), dtype=torch.long, device="cuda")
            if it:
                torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(idx)
            loss.backward()
            del loss
            opt.step()
            opt.zero_grad(set_to_none=True)
        return moved, torch.cuda.max_memory_allocated()


def test_estimate_peak_is_the_scripts_peak_on_the_gpus_engine() -> None:
    r = vram.estimate(GPT, torch.empty(B, T, dtype=torch.long), optimizer="adamw", amp="bf16",
                      loss=lambda out: out, iterations=2, gpu="H100")
    (moved, gpu_like), (_, mode_like) = _script("privateuse1"), _script("meta")
    assert gpu_like != mode_like  # the out-of-place accumulations show at this model's peak
    assert r.peak_allocated == gpu_like
    assert r.categories["parameters"] == moved  # blocks as the allocator cut them; the tie once
    unique = {id(p): p for p in GPT().parameters()}.values()
    assert r.parameters_count == sum(p.numel() for p in unique) == 124_475_904
