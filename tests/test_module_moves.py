"""Moving a model built on the CPU to the simulated GPU keeps its Parameter objects.

On a GPU, ``Module._apply`` moves each Parameter with ``param.data = moved`` (CPU and CUDA
tensors have compatible implementations), so the objects survive: tied weights stay tied and
are stored once, an optimizer built before the move sees the moved parameters, and attributes
and hooks set on a parameter stay. Expected bytes follow the allocator's rule that every block
is a multiple of 512 bytes (spec §4), summed over the model's *unique* storages.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from vram.run.runtime import simulated_cuda  # noqa: E402


def _round512(n: int) -> int:
    return max(512, -(-n // 512) * 512) if n else 0


def _unique_storage_bytes(m: Any) -> int:
    seen: dict[int, int] = {}
    for t in list(m.parameters()) + list(m.buffers()):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(_round512(n) for n in seen.values())


class TiedLM(nn.Module):
    """An embedding tied to the output projection (GPT-2, nanoGPT), a norm and a buffer."""

    def __init__(self, vocab: int = 1000, dim: int = 256) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("pos", torch.zeros(128, dim))

    def forward(self, x: Any) -> Any:
        return self.head(self.norm(self.emb(x) + self.pos[: x.shape[1]]))


MOVES: list[tuple[str, Callable[[Any], Any], Any]] = [
    ("to(device)", lambda m: m.to("cuda"), torch.float32),
    ("to(torch.device)", lambda m: m.to(torch.device("cuda", 0)), torch.float32),
    ("to(device, dtype)", lambda m: m.to("cuda", torch.bfloat16), torch.bfloat16),
    ("to(dtype=, device=)", lambda m: m.to(dtype=torch.float16, device="cuda"), torch.float16),
    ("cuda()", lambda m: m.cuda(), torch.float32),
    ("cuda(0)", lambda m: m.cuda(0), torch.float32),
    ("to_empty", lambda m: m.to_empty(device="cuda"), torch.float32),
]


@pytest.mark.parametrize("name, move, dtype", MOVES, ids=[m[0] for m in MOVES])
def test_move_keeps_parameters_ties_attributes_and_hooks(name: str, move: Callable[[Any], Any], dtype: Any) -> None:
    with simulated_cuda(gpu="24GiB"):
        m = TiedLM()
        cpu_count = sum(p.numel() for p in m.parameters())
        expected = _unique_storage_bytes(m.to(dtype)) if dtype != torch.float32 else _unique_storage_bytes(m)
        weight = m.emb.weight
        weight.no_decay = True  # an attribute, as training code sets them
        ran: list[int] = []
        weight.register_hook(lambda g: ran.append(1))
        move(m)
        assert m.emb.weight is weight and m.head.weight is weight  # the same object, still tied
        assert weight.is_cuda and weight.device == torch.device("cuda", 0) and weight.dtype == dtype
        assert isinstance(weight, nn.Parameter) and weight.requires_grad and weight.no_decay is True
        assert sum(p.numel() for p in m.parameters()) == cpu_count  # ties: counted once
        assert torch.cuda.memory_allocated() == expected
        if name != "to_empty":  # (to_empty's uninitialized weights are as good for shapes)
            x = torch.randint(0, 1000, (2, 16), device="cuda")
            m(x).float().sum().backward()
            assert ran == [1] and weight.grad is not None and weight.grad.is_cuda


def test_tied_weight_is_charged_once() -> None:
    """GPT-2's wte/lm_head: 1000 x 256 float32 = 1,024,000 B, stored once."""
    with simulated_cuda(gpu="24GiB"):
        m = TiedLM().to("cuda")
        assert m.head.weight is m.emb.weight
        # emb/head weight 1,024,000 (a 512 multiple) + LayerNorm 2 x 1,024 + pos 131,072
        assert torch.cuda.memory_allocated() == 1_024_000 + 2 * 1024 + 131_072


def test_optimizer_built_before_the_move_steps_the_moved_parameters() -> None:
    """nanoGPT/HF order: the optimizer is often built from ``model.parameters()`` first. Adam's
    state (exp_avg, exp_avg_sq per parameter) is then allocated on the GPU at the first step."""
    with simulated_cuda(gpu="24GiB"):
        m = TiedLM()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=False)
        m.to("cuda")
        params = list(m.parameters())
        param_bytes = sum(_round512(p.untyped_storage().nbytes()) for p in params)
        m(torch.randint(0, 1000, (2, 16), device="cuda")).float().sum().backward()
        grads = sum(_round512(p.grad.untyped_storage().nbytes()) for p in params)
        assert grads == param_bytes
        before = torch.cuda.memory_allocated()
        opt.step()
        assert len(opt.state) == len(params) == 3  # the tied weight is one parameter
        for p in params:
            assert opt.state[p]["exp_avg"].is_cuda and opt.state[p]["exp_avg_sq"].is_cuda
        # two state tensors per parameter; ``step`` stays a CPU scalar (not capturable/fused)
        assert torch.cuda.memory_allocated() - before == 2 * param_bytes


def test_parameter_with_a_gradient_moves_with_it() -> None:
    with simulated_cuda(gpu="24GiB"):
        lin = nn.Linear(256, 256)
        lin(torch.randn(4, 256)).sum().backward()  # CPU gradients
        w = lin.weight
        lin.cuda()
        assert lin.weight is w and w.is_cuda and w.grad is not None and w.grad.is_cuda
        assert w.grad.shape == w.shape
        # weight + bias and their gradients: 262,144 + 1,024 each
        assert torch.cuda.memory_allocated() == 2 * (262_144 + 1024)


def test_data_assignment_idiom() -> None:
    """``p.data = p.data.cuda()`` (older training code) keeps the Parameter too."""
    with simulated_cuda(gpu="24GiB"):
        p = nn.Parameter(torch.zeros(1024))
        p.data = p.data.cuda()
        assert isinstance(p, nn.Parameter) and p.is_cuda and p.requires_grad
        assert torch.cuda.memory_allocated() == 4096


def test_moving_between_simulated_tensors_is_untouched() -> None:
    """Meta-to-meta and CUDA-to-CUDA moves take PyTorch's own path (no swap)."""
    with simulated_cuda(gpu="24GiB", device_count=2):
        m = nn.Linear(64, 64).cuda()
        w = m.weight
        m.to(torch.bfloat16)
        assert m.weight is w and w.dtype == torch.bfloat16 and w.is_cuda
        m.to("cuda:1")
        assert m.weight is w and w.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(0) == 0
        assert torch.cuda.memory_allocated(1) == _round512(64 * 64 * 2) + _round512(64 * 2)
