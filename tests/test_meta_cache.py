"""The PrivateUse1 engine's remembered meta runs (`vram.run.engine.meta_cache`): a training step
allocates the same bytes in the same order with every op's meta kernel run and with the meta
runs remembered, and whatever a meta kernel's output depends on (strides, the default dtype,
the kind and sign of a number) keeps calls apart."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = pytest.importorskip("torch.nn")

from vram.allocator import caching  # noqa: E402
from vram.estimate.engine import estimate  # noqa: E402
from vram.run.engine import meta_cache  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch._C, "_acc"), reason="needs torch._C._acc (Python PrivateUse1)")


class _Block(nn.Module):
    """A pre-norm transformer block as nanoGPT writes it (causal SDPA, tanh GELU)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class _TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(1000, 64), nn.Embedding(128, 64)
        self.blocks = nn.ModuleList(_Block(64, 4) for _ in range(2))
        self.ln = nn.LayerNorm(64)
        self.head = nn.Linear(64, 1000, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3, stride=2),
                                  nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _allocations(monkeypatch: pytest.MonkeyPatch, run: Any) -> list[tuple[Any, ...]]:
    """Every ``malloc`` (size, stream, address) and ``free`` (address) of every simulated
    allocator while `run` runs, in order, and the estimate's figures."""
    log: list[tuple[Any, ...]] = []
    malloc, free = caching.CachingAllocator.malloc, caching.CachingAllocator.free

    def logged_malloc(self: Any, size: Any, stream: Any = 0) -> int:
        ptr = malloc(self, size, stream)
        log.append(("malloc", size, stream, ptr))
        return ptr

    def logged_free(self: Any, ptr: Any) -> None:
        log.append(("free", ptr))
        free(self, ptr)

    with monkeypatch.context() as m:
        m.setattr(caching.CachingAllocator, "malloc", logged_malloc)
        m.setattr(caching.CachingAllocator, "free", logged_free)
        r = run()
    return [*log, ("figures", r.peak_allocated, r.peak_reserved, tuple(sorted(r.categories.items())))]


@pytest.mark.parametrize("model, inputs, kw", [
    (_TinyGPT, torch.Size([4, 128]), {"optimizer": "adamw"}),
    (_TinyGPT, torch.Size([4, 128]), {"optimizer": "adamw", "amp": "bf16", "checkpoint": True}),
    (_ConvNet, torch.Size([4, 3, 32, 32]), {"optimizer": "adam", "amp": "fp16"}),
], ids=["fp32", "bf16-checkpoint", "conv-fp16"])
def test_remembered_meta_runs_allocate_the_same(monkeypatch: pytest.MonkeyPatch, model: Any, inputs: Any,
                                                kw: dict[str, Any]) -> None:
    """Three steps with every op's meta kernel run, then with the meta runs remembered (from
    none, then all seen): the same allocations, byte for byte, in the same order."""
    x = torch.empty(inputs, dtype=torch.long if model is _TinyGPT else torch.float32)

    def run() -> Any:
        return estimate(model, x, gpu="24GiB", **kw)

    monkeypatch.setattr(meta_cache, "enabled", False)
    every_kernel = _allocations(monkeypatch, run)
    monkeypatch.setattr(meta_cache, "enabled", True)
    meta_cache.clear()
    first = _allocations(monkeypatch, run)
    assert meta_cache._CACHE, "the engine remembered nothing"
    again = _allocations(monkeypatch, run)
    assert len(every_kernel) > 100
    assert first == every_kernel
    assert again == every_kernel


def _requests(fn: Any) -> list[int]:
    torch.cuda.memory._record_memory_history()
    fn()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    return [e["size"] for e in trace if e["action"] == "alloc"]


def test_strides_keep_calls_apart() -> None:
    """``x * 2`` follows its input's layout (TensorIterator): a transposed input and a contiguous
    one of the same sizes give the CPU's output strides each, not the first call's."""
    meta_cache.clear()
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        transposed = torch.empty(64, 32, device="cuda").t()
        contiguous = torch.empty(32, 64, device="cuda")
        assert (transposed * 2).stride() == (torch.empty(64, 32).t() * 2).stride() == (1, 32)
        assert (contiguous * 2).stride() == (torch.empty(32, 64) * 2).stride() == (64, 1)


def test_default_dtype_keeps_calls_apart() -> None:
    """An integer tensor times a Python float takes the default dtype (type promotion): 4 bytes
    per element under float32, 8 under float64, for the same call."""
    meta_cache.clear()
    before = torch.get_default_dtype()
    cpu = torch.ones(3, dtype=torch.int32)
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        i = torch.ones(1000, dtype=torch.int32, device="cuda")
        try:
            assert (cpu * 1.5).dtype == torch.float32
            assert _requests(lambda: i * 1.5) == [4000]
            torch.set_default_dtype(torch.float64)
            assert (cpu * 1.5).dtype == torch.float64
            assert _requests(lambda: i * 1.5) == [8000]
        finally:
            torch.set_default_dtype(before)


def test_key_tells_numbers_apart() -> None:
    """A bool and an int, an int and a float, 0.0 and -0.0 are different arguments; the same
    call is the same key."""
    t = torch.empty(4, 4)
    add = torch.ops.aten.add.Scalar

    def key(*args: Any) -> Any:
        return meta_cache.key(add, args, {}, "cpu")

    assert key(t, 1) == key(t, 1)
    assert len({key(t, True), key(t, 1), key(t, 1.0), key(t, 0.0), key(t, -0.0)}) == 5
    assert key(t, 1) != key(t.t(), 1)
    assert key(t, 1) != key(t.double(), 1)
    assert key(t, 1) != key(t[1:], 1)


def test_calls_not_remembered() -> None:
    """A tensor of another device (a meta kernel may read a host tensor's values), a generator,
    a random op, an op outside aten, or the cache turned off: no key."""
    t = torch.empty(4)
    assert meta_cache.key(torch.ops.aten.mul.Tensor, (t, torch.ones(())), {}, "meta") is None
    assert meta_cache.key(torch.ops.aten.uniform_.default, (t,), {}, "cpu") is None
    assert meta_cache.key(torch.ops.aten.exponential_.default, (t,), {}, "cpu") is None
    assert meta_cache.key(torch.ops.aten.add.Scalar, (t, 1), {"generator": torch.Generator()}, "cpu") is None
    assert meta_cache.key(torch.ops.prims.neg.default, (t,), {}, "cpu") is None
    assert meta_cache.key(torch.ops.aten.neg.default, (t,), {}, "cpu") is not None
    meta_cache.enabled = False
    try:
        assert meta_cache.key(torch.ops.aten.neg.default, (t,), {}, "cpu") is None
    finally:
        meta_cache.enabled = True
