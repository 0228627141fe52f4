"""The engine's compiled per-op path (``_fast.cpp``, `vram.run.engine.native.fast`) against its
Python references: new storages against `vram.run.engine.dlpack.new_storage` (at::fromDLPack of
a NumPy capsule: the same tensor, geometry, storage, device, dispatch keys and autograd state, the
same death report, the same refusals), a tensor's block against
`vram.run.engine.privateuse1._block_reference`, the meta cache's key against
`vram.run.engine.meta_cache.key_reference`, views against `vram.run.engine.views.view_of_reference`;
and the same allocations for a training step with
each compiled part and without."""
from __future__ import annotations

import gc
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from vram.allocator import caching  # noqa: E402
from vram.run.engine import dlpack, meta_cache, native, privateuse1, views  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch._C, "_acc"), reason="needs torch._C._acc (Python PrivateUse1)")

LAYOUTS = {
    "contiguous": lambda: torch.empty(12, 7, device="meta"),
    "transposed": lambda: torch.empty(7, 12, device="meta").t(),
    "scalar": lambda: torch.empty((), device="meta"),
    "empty": lambda: torch.empty(0, 5, device="meta"),
    "empty-view-of-storage": lambda: torch.empty(6, device="meta")[3:3],
    "expanded": lambda: torch.empty(4, 3, device="meta").expand(2, 4, 3),
    "offset": lambda: torch.empty(10, dtype=torch.bfloat16, device="meta")[2:],
    "short-of-storage": lambda: torch.empty(10, device="meta")[:4],
    "strided": lambda: torch.empty(10, device="meta")[1::3],
    "channels-last": lambda: torch.empty(2, 3, 4, 5, device="meta").to(memory_format=torch.channels_last),
    "size-one-dims": lambda: torch.empty(1, 5, 1, 3, device="meta").permute(2, 3, 0, 1),
    "int64-row": lambda: torch.empty(3, 4, dtype=torch.int64, device="meta")[1],
}


@pytest.fixture(scope="module")
def fast() -> Any:
    with simulated_cuda(gpu="24GiB"):  # registers PrivateUse1 (and builds the library)
        pass
    module = native.fast()
    if module is None:
        pytest.skip("the engine's compiled module could not be built here")
    return module


def _facts(t: Any) -> tuple[Any, ...]:
    """Everything a caller can see of a new storage's tensor."""
    storage = t.untyped_storage()
    formats = (torch.contiguous_format, torch.channels_last) if t.dim() == 4 else (torch.contiguous_format,)
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.layout,
            storage.nbytes(), storage.resizable(), storage.device, torch._C._data_address(t), t.data_ptr(),
            str(torch._C._dispatch_keys(t)), tuple(t.is_contiguous(memory_format=f) for f in formats),
            t._is_view(), t._base is None, t.requires_grad, t.is_leaf,
            t._version, type(t))


def _made(new_storage: Any, meta: Any, device: int, address: int, nbytes: int) -> tuple[Any, list[Any]]:
    """The facts of the tensor `new_storage` makes, and the deaths reported once it is dropped."""
    died: list[tuple[int, int]] = []
    with torch._C.DisableTorchFunction():
        t = new_storage(meta, device, address, lambda device, address: died.append((device, address)), nbytes)
        facts = _facts(t)
        assert not died
        del t
        gc.collect()
    return facts, died


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("address", [1 << 34, 0], ids=["address", "no-address"])
def test_same_tensor_as_dlpack(fast: Any, layout: str, address: int) -> None:
    meta = LAYOUTS[layout]()
    nbytes = meta.untyped_storage().nbytes() if address else 0
    if not address and meta.numel():
        meta = torch.empty(0, 2, dtype=meta.dtype, device="meta")
    ours = _made(fast.new_storage, meta, 1, address, nbytes)
    reference = _made(dlpack.new_storage, meta, 1, address, nbytes)
    assert ours == reference
    assert ours[0][:3] == (tuple(meta.shape), meta.stride(), meta.storage_offset())
    assert ours[1] == [(1, address)]


@pytest.mark.parametrize("dtype", list(dlpack.CODES), ids=str)
def test_same_tensor_for_each_dtype(fast: Any, dtype: Any) -> None:
    meta = torch.empty(3, 5, dtype=dtype, device="meta").t()[1:]
    nbytes = meta.untyped_storage().nbytes()
    assert _made(fast.new_storage, meta, 0, 1 << 35, nbytes) == _made(dlpack.new_storage, meta, 0, 1 << 35, nbytes)


def test_a_dtype_without_a_dlpack_code_is_refused_alike(fast: Any) -> None:
    meta = torch.empty(4, dtype=torch.float8_e4m3fn, device="meta")
    messages = []
    for new_storage in (fast.new_storage, dlpack.new_storage):
        with pytest.raises(NotImplementedError) as e:
            new_storage(meta, 0, 1 << 34, lambda device, address: None, 4)
        messages.append(str(e.value))
    assert messages[0] == messages[1] == "vram run --backend privateuse1: no DLPack code for torch.float8_e4m3fn yet"


@pytest.mark.parametrize("args", [
    ("not a tensor", 0, 1 << 34, print, 4),
    (torch.empty(1, device="meta"), 0, 1 << 34, "not callable", 4),
    (torch.empty(1, device="meta"), "0", 1 << 34, print, 4),
    (torch.empty(1, device="meta"), 0, 1 << 34, print),
], ids=["meta", "died", "device", "arity"])
def test_bad_arguments_raise_type_error(fast: Any, args: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError):
        fast.new_storage(*args)


def test_an_error_in_the_death_report_is_unraisable(fast: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's own error goes to ``sys.unraisablehook`` (as an error in ``__del__`` does), and
    an error being raised while a storage dies is the one that arrives."""
    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.exc_value))

    def died(device: int, address: int) -> None:
        raise ValueError(f"report of {address}")

    meta = torch.empty(4, device="meta")
    t = fast.new_storage(meta, 0, 1 << 34, died, 16)
    del t
    assert [str(e) for e in seen] == [f"report of {1 << 34}"]
    with pytest.raises(KeyError, match="raised"):
        try:
            u = fast.new_storage(meta, 0, 1 << 33, died, 16)
            raise KeyError("raised")
        finally:
            del u
    assert len(seen) == 2


def _step() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    for _ in range(2):
        x = torch.empty(8, 16, device="cuda")
        model(x.view(2, 4, 16)[:, 1:].reshape(-1, 16)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    events: list[tuple[str, int]] = []
    malloc, free = caching.CachingAllocator.malloc, caching.CachingAllocator.free

    def logged_malloc(self: Any, size: Any, stream: Any = 0) -> int:
        ptr = malloc(self, size, stream)
        events.append(("malloc", size, ptr))  # type: ignore[arg-type]
        return ptr

    def logged_free(self: Any, ptr: Any, *args: Any, **kwargs: Any) -> Any:
        events.append(("free", ptr))
        return free(self, ptr, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(caching.CachingAllocator, "malloc", logged_malloc)
        m.setattr(caching.CachingAllocator, "free", logged_free)
        with simulated_cuda(gpu="24GiB"):
            _step()
    return events


def test_a_training_step_allocates_alike(fast: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same step with the engine's compiled parts and with their Python references: the same
    mallocs and frees, in the same order."""
    assert privateuse1.NEW_STORAGE[0] is fast.new_storage and privateuse1._PLACE[0] is fast.place
    assert meta_cache._COMPILED == [fast.key, privateuse1.NAME] and views.COMPILED[0] is fast.view_of
    meta_cache.clear()
    ours = _events(monkeypatch)
    monkeypatch.setattr(privateuse1, "NEW_STORAGE", [dlpack.new_storage])
    monkeypatch.setattr(privateuse1, "_PLACE", [None])
    monkeypatch.setattr(meta_cache, "_COMPILED", [None, None])
    monkeypatch.setattr(views, "COMPILED", [None])
    meta_cache.clear()
    reference = _events(monkeypatch)
    assert ours == reference
    assert sum(e[0] == "malloc" for e in ours) > 10 and sum(e[0] == "free" for e in ours) > 10


class _Sub(torch.Tensor):
    pass


def _tensors() -> list[Any]:
    """Simulated tensors of several layouts, host, meta and sparse ones, a subclass, a parameter."""
    x = torch.empty(6, 4, device="cuda")
    return [x, x[2:], x.t(), x.view(-1)[3:], torch.empty(0, device="cuda"), torch.empty((), device="cuda:1"),
            torch.empty(5, dtype=torch.float16, device="cuda")[1:], torch.nn.Parameter(torch.empty(3, device="cuda")),
            torch.empty(3), torch.empty(3, device="meta"), torch.empty(2, device="cuda").as_subclass(_Sub),
            torch.empty(4, 4).to_sparse()]


def test_place_finds_the_reference_block(fast: Any) -> None:
    """`_block` with ``place`` and `_block_reference` find the same block for every tensor, and
    ``place`` leaves subclasses and other TensorImpls to the reference."""
    with simulated_cuda(gpu="24GiB", device_count=2):
        sim = privateuse1._STATE[-1]
        tensors = _tensors()
        with torch._C.DisableTorchFunction():
            places = [fast.place(t) for t in tensors]
            found = [privateuse1._block(sim.blocks, sim._empty, t) for t in tensors]
            assert found == [privateuse1._block_reference(sim.blocks, sim._empty, t) for t in tensors]
        assert all(isinstance(p, tuple) for p in places[:8]) and places[8:10] == [None, None]
        assert places[10:] == [NotImplemented, NotImplemented]
        assert places[5][0] == 1 and found[0] is found[1] is found[2] is found[3] is not None
        assert found[4] is sim._empty[0] and found[8] is None


def _calls() -> list[tuple[Any, Any, Any]]:
    x = torch.empty(6, 4, device="cuda")
    return [
        (torch.ops.aten.add.Tensor, (x, x.t().t()), {"alpha": 2}),
        (torch.ops.aten.add.Tensor, (x, 1.5), {}),
        (torch.ops.aten.add.Tensor, (x, -0.0), {}),
        (torch.ops.aten.add.Tensor, (x, 0.0), {}),
        (torch.ops.aten.add.Tensor, (x, float("nan")), {}),
        (torch.ops.aten.add.Tensor, (x, True), {}),
        (torch.ops.aten.add.Tensor, (x, 1), {}),
        (torch.ops.aten.add.Tensor, (x, 1 + 2j), {}),
        (torch.ops.aten.view.default, (x, [24]), {}),
        (torch.ops.aten.view.default, (x, (24,)), {}),
        (torch.ops.aten.view.default, (x, torch.Size([24])), {}),  # torch.Size: never remembered
        (torch.ops.aten.as_strided.default, (x[1:], [2, 2], [4, 1], 3), {}),
        (torch.ops.aten.sum.dim_IntList, (x, [0, [1, None]]), {"dtype": torch.float16, "keepdim": False}),
        (torch.ops.aten.empty.memory_format, ([2, 3],), {"device": torch.device("cuda", 0),
                                                        "layout": torch.strided, "pin_memory": None,
                                                        "memory_format": torch.channels_last, "dtype": None}),
        (torch.ops.aten.mean.dim, (x, [0], False), {"out": x}),
        (torch.ops.aten.add.Tensor, (x, torch.empty(4)), {}),  # a host tensor: never remembered
        (torch.ops.aten.add.Tensor, (x, torch.empty(4, device="meta")), {}),
        (torch.ops.aten.add.Tensor, (x, torch.nn.Parameter(torch.empty(4, device="cuda"))), {}),
        (torch.ops.aten.add.Tensor, (x, x.as_subclass(_Sub)), {}),  # a subclass: the reference decides
        (torch.ops.aten.add.Tensor, (x, [x, "mean", object()]), {}),
        (torch.ops.aten.add.Tensor, (x, x), {"alpha": object()}),
        (torch.ops.aten.mm.default, (x.to_sparse(), x.t()), {}),
        (torch.ops.aten.cat.default, ([x, x.t().contiguous().t()],), {"dim": -1}),
        (torch.ops.aten.add.Tensor, (x, True.__class__(0)), {}),
    ]


CALLS = 24


def test_calls_listed() -> None:
    with simulated_cuda(gpu="24GiB"):
        assert len(_calls()) == CALLS


@pytest.mark.parametrize("call", range(CALLS))
def test_key_is_the_reference_key(fast: Any, call: int) -> None:
    """The compiled key of each call equals the reference's (None: not remembered), or defers to it."""
    with simulated_cuda(gpu="24GiB"):
        op, args, kwargs = _calls()[call]
        settings = meta_cache._settings()
        with torch._C.DisableTorchFunction():
            ours = fast.key(op, settings, args, kwargs)
            reference = meta_cache.key_reference(op, settings, args, kwargs, privateuse1.NAME)
            assert meta_cache.key(op, args, kwargs, privateuse1.NAME) == reference
        if ours is not NotImplemented:
            assert ours == reference and (ours is None or hash(ours) == hash(reference))
        else:
            assert call in (18, 21)  # a Tensor subclass, a SparseTensorImpl


def test_keys_keep_calls_apart(fast: Any) -> None:
    """Distinct calls have distinct compiled keys (as the reference's are)."""
    with simulated_cuda(gpu="24GiB"):
        settings, calls = meta_cache._settings(), _calls()[:10]
        with torch._C.DisableTorchFunction():
            keys = [fast.key(op, settings, args, kwargs) for op, args, kwargs in calls]
    assert keys[2] != keys[3] and None not in keys and len(set(keys)) == len(keys)


def test_view_of_is_the_reference_view(fast: Any) -> None:
    """``view_of`` gives the view `view_of_reference` gives (the CPU kernel of ``as_strided``), and
    leaves views that change the dtype, subclasses and other TensorImpls to it."""
    with simulated_cuda(gpu="24GiB"):
        x = torch.empty(6, 4, device="cuda")
        h = torch.empty(8, dtype=torch.float16, device="cuda")
        p = torch.nn.Parameter(torch.empty(3, 5, device="cuda"))
        cases = [(x, torch.empty(6, 4, device="meta").t()), (x, torch.empty(24, device="meta")[5:17:3]),
                 (h, torch.empty(8, dtype=torch.float16, device="meta")[2:].view(2, 3)),
                 (p, torch.empty(15, device="meta").as_strided((5, 3), (1, 5), 0)),
                 (x[1:], torch.empty(0, device="meta")), (x, torch.empty((), device="meta"))]
        with torch._C.DisableTorchFunction():
            for src, meta in cases:
                ours, reference = fast.view_of(src, meta), views.view_of_reference(src, meta)
                assert _facts(ours) == _facts(reference)
                assert _facts(views.view_of(src, meta)) == _facts(reference)
            assert fast.view_of(h, torch.empty(4, dtype=torch.float32, device="meta")) is NotImplemented
            assert fast.view_of(x.as_subclass(_Sub), torch.empty(4, device="meta")) is NotImplemented
            assert fast.view_of(x, torch.empty(4, device="meta").as_subclass(_Sub)) is NotImplemented
            complex_view = views.view_of(h, torch.empty(4, dtype=torch.float32, device="meta"))
            assert complex_view.dtype == torch.float32 and complex_view.shape == (4,)


def test_built_where_a_compiler_and_python_headers_are() -> None:
    """Where ``c++`` and Python's headers are present the compiled module must build (a compile
    error would otherwise leave every engine run on the slower references, silently)."""
    import os
    import shutil
    import sysconfig
    from pathlib import Path

    if shutil.which(os.environ.get("CXX", "c++")) is None or \
            not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no C++ compiler or no Python headers here")
    assert native.fast() is not None
