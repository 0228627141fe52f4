"""Lazy host tensors: a model built on the CPU costs nothing until its bytes are
needed, and then they are exact; the CPU generator's stream is the one a GPU run would see.

Every expectation is PyTorch's own behaviour on real CPU tensors, computed in the test outside the
simulation with the same seed."""
from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn as nn

from vram.run.memory.host_rng import advance, word_count
from vram.run.runtime import active_sim, simulated_cuda


def _state_after(op: Any) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    op(g)
    return g.get_state()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [16, 17, 1000, 1024, 65_537, 100_003])
def test_word_counts_match_the_cpu_kernels(dtype: torch.dtype, n: int) -> None:
    """The words `uniform_`/`normal_` draw, as `host_rng.word_count` models them, are the words the
    CPU kernels draw: the generator ends in the same state."""
    for name in ("uniform_", "normal_"):
        t = torch.empty(n, dtype=dtype)
        words = word_count(name, t)
        assert words is not None
        real = _state_after(lambda g, t=t, name=name: getattr(t, name)(generator=g))
        assert torch.equal(real, _state_after(lambda g, w=words: advance(g, w))), (name, dtype, n)


def test_unmodelled_shapes_are_replayed() -> None:
    t = torch.empty(64, 64).t()  # non-contiguous: normal_ takes its per-element path
    assert word_count("normal_", t) is None
    assert word_count("normal_", torch.empty(8)) is None  # fewer than 16 elements
    assert word_count("uniform_", torch.empty(8, dtype=torch.int32)) is None


class Net(nn.Module):
    """Large enough to be lazy (> 65,536 elements per weight), with the usual initialisers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 128, padding_idx=0)
        self.fc1 = nn.Linear(128, 600)
        self.fc2 = nn.Linear(600, 128)
        self.head = nn.Linear(128, 1000, bias=False)
        self.head.weight = self.emb.weight
        nn.init.trunc_normal_(self.fc1.weight, std=0.02)
        nn.init.orthogonal_(self.fc2.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.relu(self.fc1(self.emb(ids)))))


def _build(seed: int = 5) -> Net:
    torch.manual_seed(seed)
    return Net()


def test_cpu_model_is_lazy_until_needed_and_then_exact() -> None:
    ref = _build()
    ids = torch.tensor([[1, 2, 3, 0]])
    ref_logits = ref(ids)
    with simulated_cuda(gpu="24GiB"):
        m = _build()
        host = active_sim().host
        big = [p for p in m.parameters() if p.numel() > 65_536]
        assert big and all(host.of(p) is not None and host.of(p).mirror is None for p in big)
        w = m.fc1.weight
        assert w.device == torch.device("cpu") and w.is_cpu and not w.is_meta and not w.is_cuda
        assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in ref.parameters())
        logits = m(ids)  # small real input, lazy weights: a lazy result
        assert host.of(logits) is not None
        assert torch.equal(logits, ref_logits)  # read: computed exactly as the CPU computes it
        assert m.fc2.weight[3, :5].tolist() == ref.fc2.weight[3, :5].tolist()
        assert m.emb.weight[0].abs().sum().item() == 0.0  # padding_idx row zeroed in place
        assert repr(m.fc1.weight) == repr(ref.fc1.weight)
        assert (m.fc1.weight.detach().numpy() == ref.fc1.weight.detach().numpy()).all()


def test_cpu_generator_stream_is_the_gpu_runs() -> None:
    """Draws after a lazy initialisation are those after a real one (settled when observed)."""
    ref = _build()
    ref_built = torch.get_rng_state()
    ref_ids = torch.randint(0, 50_000, (4, 8))
    ref_state = torch.get_rng_state()
    with simulated_cuda(gpu="24GiB"):
        m = _build()
        ids = torch.randint(0, 50_000, (4, 8))
        assert torch.equal(ids, ref_ids)
        assert torch.equal(torch.get_rng_state(), ref_state)
        assert torch.equal(m.fc1.weight, ref.fc1.weight)
    with simulated_cuda(gpu="24GiB"):
        _build()
        assert torch.equal(torch.get_rng_state(), ref_built)  # get_rng_state settles too
    with simulated_cuda(gpu="24GiB"):
        m = _build()
        torch.manual_seed(7)  # replaces the state: nothing owed
        after_reseed = torch.randn(5)
        assert torch.equal(m.fc2.weight, ref.fc2.weight)  # values still known after the reseed
    torch.manual_seed(7)
    assert torch.equal(after_reseed, torch.randn(5))


def test_explicit_generator_is_advanced_now() -> None:
    def init(g: torch.Generator) -> torch.Tensor:
        w = torch.empty(400, 300)
        nn.init.normal_(w, std=0.5, generator=g)
        return w
    g_ref = torch.Generator().manual_seed(3)
    ref = init(g_ref)
    with simulated_cuda(gpu="24GiB"):
        g = torch.Generator().manual_seed(3)
        w = init(g)
        assert active_sim().host.of(w) is not None
        assert torch.equal(g.get_state(), g_ref.get_state())
        assert torch.equal(w, ref)


def test_move_to_gpu_charges_only_the_gpu() -> None:
    with simulated_cuda(gpu="24GiB"):
        m = _build()
        m.to("cuda", dtype=torch.bfloat16)
        unique = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in m.parameters()}
        assert m.fc1.weight.is_cuda and m.head.weight is m.emb.weight
        assert torch.cuda.memory_allocated() == sum(-(-n // 512) * 512 for n in unique.values())


def test_save_deepcopy_and_load_state_dict() -> None:
    ref = _build()
    with simulated_cuda(gpu="24GiB"):
        m = _build()
        twin = copy.deepcopy(m)
        assert twin.fc1.weight.device.type == "cpu" and twin.fc1.weight is not m.fc1.weight
        buf = io.BytesIO()
        torch.save(twin.state_dict(), buf)
        other = Net()  # fresh lazy weights, overwritten from real host tensors
        other.load_state_dict(ref.state_dict())
        assert torch.equal(other.fc2.weight, ref.fc2.weight)
    buf.seek(0)
    saved = torch.load(buf)
    assert all(torch.equal(saved[k], v) for k, v in ref.state_dict().items())


def test_data_dependent_op_on_lazy_tensor_runs_on_real_bytes() -> None:
    torch.manual_seed(1)
    ref = torch.rand(300, 300)
    with simulated_cuda(gpu="24GiB"):
        torch.manual_seed(1)
        x = torch.rand(300, 300)
        assert active_sim().host.of(x) is not None
        idx = (x > 0.5).nonzero()
        assert torch.equal(idx, (ref > 0.5).nonzero())


def test_dataloader_over_a_lazy_dataset_gives_the_cpu_batches() -> None:
    """A synthetic dataset drawn on the CPU (lazy), shuffled and batched in worker processes:
    the batches, moved to the GPU, hold the values a CPU/GPU run's batches hold."""
    from torch.utils.data import DataLoader, TensorDataset

    def batches() -> list[list[float]]:
        torch.manual_seed(0)
        ds = TensorDataset(torch.randn(20_000, 64), torch.randint(0, 10, (20_000,)))
        seen = []
        for workers in (0, 2):
            for i, (x, _) in enumerate(DataLoader(ds, batch_size=256, shuffle=True, num_workers=workers)):
                if i == 2:
                    seen.append(x.to("cuda" if torch.cuda.is_available() else x.device)[0, :3].tolist())
                    break
        return seen
    expected = batches()
    with simulated_cuda(gpu="24GiB"):
        assert batches() == expected


_FACTORY_CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("zeros", (4,), {}), ("zeros", (2, 3), {}), ("ones", ([4, 5],), {}), ("empty", ((2, 0, 3),), {}),
    ("full", ((3, 7), 1.5), {}), ("rand", (3, 4), {}), ("randn", (), {"size": (6,)}),
    ("randint", (10, (3, 2)), {}), ("randint", (2, 10, (5,)), {}), ("randint", (9,), {"size": [7]}),
    ("randperm", (11,), {}), ("arange", (8,), {}), ("arange", (2, 9), {}), ("arange", (0, 1, 0.3), {}),
    ("arange", (10, 0, -3), {}), ("arange", (5, 5), {}), ("eye", (4,), {}), ("eye", (3, 5), {}),
    ("linspace", (0, 1, 7), {}), ("logspace", (0, 2), {"steps": 4}),
    ("empty_strided", ((2, 3), (3, 1)), {}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), _FACTORY_CALLS)
def test_factory_size_read_off_the_arguments_is_the_tensors(name: str, args: tuple[Any, ...],
                                                           kwargs: dict[str, Any]) -> None:
    """The size hint that keeps small CPU factories off the lazy path (no dispatch mode pushed)
    is the element count PyTorch's own call makes."""
    from vram.run.memory.lazy_host import factory_numel
    assert factory_numel(name, args, kwargs) == getattr(torch, name)(*args, **kwargs).numel()
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    expected = getattr(torch, name)(*args, **kwargs)
    with simulated_cuda(gpu="24GiB"):
        t = getattr(torch, name)(*args, **kwargs)
        pushed = _get_current_dispatch_mode()  # before any other torch call could pop it
        assert pushed is None and not t.is_meta
        if name not in ("empty", "empty_strided", "rand", "randn", "randint", "randperm"):
            assert torch.equal(t, expected)


def _redraws(keep_limit: int | None = None) -> tuple[torch.Tensor, list[Any], int]:
    """``trunc_normal_`` of a lazy [600, 128] tensor under a simulated run (with `keep_limit`
    bytes of computed values kept, None: the default): its values after the settled stream,
    the steps each evaluation computed, and the words replayed from the ledger."""
    from vram.run.memory import host_rng, lazy_host

    applied: list[Any] = []  # the steps themselves: their ids stay unique while they are held
    replayed = [0]
    apply, advance_words = lazy_host.LazyHost._apply, host_rng.advance

    def counting_apply(self: Any, step: Any, *args: Any) -> Any:
        applied.append(step)
        return apply(self, step, *args)

    def counting_advance(gen: torch.Generator, words: int) -> None:
        replayed[0] += words
        advance_words(gen, words)
    mp = pytest.MonkeyPatch()
    mp.setattr(lazy_host.LazyHost, "_apply", counting_apply)
    mp.setattr(host_rng, "advance", counting_advance)
    try:
        with simulated_cuda(gpu="24GiB"):
            host = active_sim().host
            if keep_limit is not None:
                host.keep_limit = keep_limit
            torch.manual_seed(3)
            w = torch.empty(600, 128)
            assert host.of(w) is not None
            nn.init.trunc_normal_(w, std=1.0, a=-2.0, b=2.0)  # ~4.6% redrawn per round: a few rounds
            assert host.kept_bytes <= host.keep_limit
            after = torch.randn(3)
            value = torch.cat([torch.from_numpy(w.numpy().copy()).flatten(), after])
    finally:
        mp.undo()
    return value, applied, replayed[0]


def test_rejection_sampling_computes_each_step_once() -> None:
    """``trunc_normal_`` reads ``mask.any()`` after each round of redraws: each read starts from
    the values the previous one computed (kept), and each deferred draw's generator state is the
    one the previous draw left (no replay of earlier draws): every step of the recipe runs once.
    The values, and the CPU generator's stream after them, are plain CPU torch's."""
    torch.manual_seed(3)
    w = torch.empty(600, 128)
    nn.init.trunc_normal_(w, std=1.0, a=-2.0, b=2.0)
    expected = torch.cat([w.flatten(), torch.randn(3)])
    got, applied, replayed = _redraws()
    assert torch.equal(got, expected)
    assert len(applied) == len({id(step) for step in applied}) and replayed == 0
    # with nothing kept, every read recomputes the recipe from its start: same values
    again, applied, _ = _redraws(keep_limit=0)
    assert torch.equal(again, expected) and len(applied) > len({id(step) for step in applied})


class Head(nn.Module):
    """A detection head's pattern (ultralytics' ``Detect``): a grid built on the host from a
    feature map's dtype (``torch.arange(w).type_as(feat)``), kept as a plain attribute, and
    moved by an ``_apply`` override (``m.anchors = fn(m.anchors)``) with the module."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 8, stride=8)
        self.anchors = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feat = self.conv(x)
        h, w = feat.shape[2:]
        sx = torch.arange(w).type_as(feat) + 0.5
        sy = torch.arange(h).to(feat) + 0.5
        sy, sx = torch.meshgrid(sy, sx, indexing="ij")
        self.anchors = torch.stack((sx, sy), -1).view(-1, 2).transpose(0, 1)
        return feat

    def _apply(self, fn: Any, recurse: bool = True) -> Head:
        super()._apply(fn, recurse)
        self.anchors = fn(self.anchors)
        return self


def test_host_tensor_taking_a_lazy_tensors_options_is_a_host_tensor() -> None:
    """``x.type_as(other)`` and ``x.to(other)`` are ``x.to(other.options())``
    (TensorConversions.cpp): with a large CPU ``other`` (lazy here) the result is a CPU tensor with
    ``x``'s values in ``other``'s dtype, and the model then moves to the GPU with its anchors;
    ``type()`` names the legacy CPU and CUDA types (tensor_types.cpp)."""
    torch.manual_seed(0)
    ref = Head()
    ref(torch.zeros(1, 3, 256, 256))
    with simulated_cuda(gpu="24GiB"):
        torch.manual_seed(0)
        m = Head()
        big = torch.zeros(1, 3, 256, 256)
        assert active_sim().host.of(big) is not None
        m(big)
        assert m.anchors.device.type == "cpu" and torch.equal(m.anchors, ref.anchors)
        assert big.type() == "torch.FloatTensor" and torch.arange(3).type(big.type()).dtype == torch.float32
        m.to("cuda")
        assert m.anchors.is_cuda and m.anchors.type() == "torch.cuda.FloatTensor"
        assert torch.equal(m.anchors.cpu(), ref.anchors)
        assert torch.ones(2, device="cuda").type_as(big).device.type == "cpu"
        assert torch.arange(2).type_as(m.anchors).is_cuda
        half = torch.ones(2).type("torch.cuda.HalfTensor")
        assert half.is_cuda and half.dtype == torch.float16


def test_tensor_a_composite_makes_with_a_lazy_inputs_options_is_a_host_tensor() -> None:
    """``one_hot`` makes its output inside C++ with its input's options (``at::zeros(shape,
    self.options())``, ATen/native/Onehot.cpp), then scatters into it: for a large CPU input the
    result is the CPU's."""
    torch.manual_seed(3)
    ref = torch.nn.functional.one_hot(torch.randint(0, 10, (70_000,)), 10).sum(0)
    with simulated_cuda(gpu="24GiB"):
        torch.manual_seed(3)
        idx = torch.randint(0, 10, (70_000,))
        assert active_sim().host.of(idx) is not None
        out = torch.nn.functional.one_hot(idx, 10)
        assert out.device.type == "cpu" and torch.equal(out.sum(0), ref)
