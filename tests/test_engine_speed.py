"""The PrivateUse1 engine's shortcuts on its per-op path, each against the reference it stands for:
the meta kernels' switches read from their config entries (against reads through the config
module), a storage found by its data address (against the data pointer less the view's offset),
storages made by DLPack with their sizes and strides (against a flat storage viewed with
``as_strided``), the model's move without ``empty_like``'s Python reference, and remembered views
taken straight to their view (against the whole of the engine's path)."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental import _config as fx_config  # noqa: E402

from vram.allocator import caching  # noqa: E402
from vram.run.engine import dlpack, meta_cache, privateuse1  # noqa: E402
from vram.run.kernels.plan import op_plan  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402
from vram.run.values import known  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch._C, "_acc"), reason="needs torch._C._acc (Python PrivateUse1)")


@pytest.mark.parametrize("switch", meta_cache._FX_SWITCHES)
def test_settings_follow_each_switch(switch: str) -> None:
    """Each meta-kernel switch, overridden with ``patch`` (its ContextVar), changes the settings
    as a read through ``torch.fx.experimental._config`` sees it."""
    assert meta_cache._SWITCHES is not None, "the fast read is not in use on this torch"
    before = meta_cache._settings()
    assert before == meta_cache._settings_reference()
    with fx_config.patch(**{switch: not getattr(fx_config, switch)}):
        inside = meta_cache._settings()
        assert inside == meta_cache._settings_reference()
        assert inside != before
    assert meta_cache._settings() == before


def test_settings_follow_the_default_dtype_and_determinism() -> None:
    saved = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert meta_cache._settings() == meta_cache._settings_reference()
        assert meta_cache._settings()[:3] == (torch.float64, True, True)
    finally:
        torch.set_default_dtype(saved)
        torch.use_deterministic_algorithms(False)
    assert meta_cache._settings()[1:3] == (False, False)


def _block_reference(sim: Any, t: Any) -> Any:
    """`BackendState.block_of` as the data pointer less the view's offset finds it."""
    with torch._C.DisableTorchFunction():
        if not isinstance(t, torch.Tensor) or t.device.type != privateuse1.NAME or not torch._C._has_storage(t):
            return None
        base = t.data_ptr() - t.storage_offset() * t.element_size()
        idx = t.device.index or 0
    return sim.blocks.get((idx, base)) or sim._empty[idx]


def test_block_of_matches_the_data_pointer() -> None:
    with simulated_cuda(gpu="24GiB"):
        sim = active_sim()
        x = torch.empty(64, 32, device="cuda")
        half = torch.empty(16, dtype=torch.float16, device="cuda")
        tensors = [x, x[3:], x.t()[5:, 2:], x.view(-1)[100:], half[7:], torch.empty(0, device="cuda"),
                   torch.empty(3), torch.empty(3, device="meta"), 1.5, None]
        found = [sim.block_of(t) for t in tensors]
        assert found == [_block_reference(sim, t) for t in tensors]
        assert found == sim.blocks_of(tensors)
        assert found[0] is found[1] is found[2] is found[3] is not None and found[0].nbytes == 64 * 32 * 4
        assert found[4] is not None and found[4].nbytes == 32
        assert found[5] is sim._empty[0] and found[6:] == [None] * 4


@pytest.mark.parametrize("make", [
    lambda: torch.empty(12, 7, device="meta"),
    lambda: torch.empty(7, 12, device="meta").t(),
    lambda: torch.empty((), device="meta"),
    lambda: torch.empty(0, 5, device="meta"),
    lambda: torch.empty(4, 3, device="meta").expand(2, 4, 3),
    lambda: torch.empty(10, dtype=torch.bfloat16, device="meta")[2:],
    lambda: torch.empty(10, device="meta")[:4],
    lambda: torch.empty(2, 3, 4, 5, device="meta").to(memory_format=torch.channels_last),
], ids=["contiguous", "transposed", "scalar", "empty", "expanded", "offset", "short-of-storage", "channels-last"])
def test_dlpack_storage_has_the_meta_geometry(make: Any) -> None:
    """A new storage (DLPack with the view's sizes and strides where the view spans it from its
    start, else flat and viewed with ``as_strided``): the meta tensor's sizes, strides, offset
    and dtype over a storage of its meta storage's size at the given address."""
    meta = make()
    nbytes = meta.untyped_storage().nbytes()
    died: list[tuple[int, int]] = []
    with simulated_cuda(gpu="24GiB"), torch._C.DisableTorchFunction():
        t = dlpack.new_storage(meta, 0, 1 << 34, lambda device, address: died.append((device, address)), nbytes)
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == \
            (meta.shape, meta.stride(), meta.storage_offset(), meta.dtype)
        assert t.untyped_storage().nbytes() == nbytes
        assert t.device == torch.device(privateuse1.NAME, 0)
        assert torch._C._data_address(t) == 1 << 34
        assert not t._is_view() and not t.requires_grad
        del t
    assert died == [(0, 1 << 34)]


def _requests(monkeypatch: pytest.MonkeyPatch, run: Any) -> tuple[list[int], Any]:
    sizes: list[int] = []
    malloc = caching.CachingAllocator.malloc

    def logged(self: Any, size: Any, stream: Any = 0) -> int:
        sizes.append(size)
        return malloc(self, size, stream)

    with monkeypatch.context() as m:
        m.setattr(caching.CachingAllocator, "malloc", logged)
        out = run()
    return sizes, out


@pytest.mark.parametrize("make", [
    lambda: torch.empty(12, 7, device="meta"),
    lambda: torch.empty(7, 12, device="meta").t(),
    lambda: torch.empty(2, 3, 4, 5, device="meta").to(memory_format=torch.channels_last),
    lambda: torch.empty(1, 5, 1, 3, device="meta").permute(2, 3, 0, 1),
    lambda: torch.empty(4, 3, dtype=torch.float16, device="meta").expand(2, 4, 3),
    lambda: torch.empty(10, device="meta")[::2],
], ids=["contiguous", "transposed", "channels-last", "size-one-dims", "expanded", "strided"])
def test_move_to_gpu_is_empty_like(monkeypatch: pytest.MonkeyPatch, make: Any) -> None:
    """`vram.estimate.model`'s move of a meta tensor asks the allocator for what
    ``torch.empty_like(t, device="cuda")`` asks, and gives the same layout."""
    from vram.estimate.model import _empty_like_on_gpu

    t = make()
    with simulated_cuda(gpu="24GiB"):
        theirs, a = _requests(monkeypatch, lambda: torch.empty_like(t, device="cuda"))
        ours, b = _requests(monkeypatch, lambda: _empty_like_on_gpu(t))
        twice, c = _requests(monkeypatch, lambda: _empty_like_on_gpu(t))  # the permutation remembered
        assert theirs == ours == twice and len(ours) == (1 if t.numel() else 0)
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype) == (c.shape, c.stride(), c.dtype)


def test_plain_views_plan_nothing() -> None:
    """What `privateuse1._plain_view` leaves out: a view's kernel plan is its one (aliasing) output."""
    x = torch.empty(6, 4, device="meta")
    for name, args in (("view", (x, [24])), ("as_strided", (x, [4, 6], [1, 4])),
                       ("as_strided", (x, [2, 2], [4, 1], 3))):
        out = torch.ops.aten.view.default(*args) if name == "view" else torch.ops.aten.as_strided.default(*args)
        assert op_plan(name, args, [out], 132, 2048, (9, 0), {}) == [("out", 0)]
    assert all(r is not None and not r.is_write for op in privateuse1._PLAIN_VIEWS
               for r in (a.alias_info for a in op._schema.returns))


def _program() -> list[Any]:
    """Views of known and unknown tensors, their values read, and a step of a small model."""
    seen: list[Any] = []
    ids = torch.arange(24, device="cuda")
    seen.append(ids.view(4, 6)[2].tolist())
    seen.append(ids.view(6, 4).t()[1].tolist())
    w = torch.nn.Linear(16, 8).cuda()
    x = torch.empty(4, 16, device="cuda", requires_grad=True)
    y = w(x.view(2, 2, 16).transpose(0, 1).reshape(4, 16)).view(-1)
    y.sum().backward()
    seen.append((tuple(y.shape), y.stride(), tuple(x.grad.shape)))
    seen.append(torch.zeros(8, device="cuda").view(2, 4).sum().item())
    sim = active_sim()
    small, large = torch.empty(8, device="cuda"), torch.empty(1 << 17, device="cuda")
    views = [small.view(2, 4), large.view(2, -1), ids.view(2, 12).t()]
    seen.append([(known.known(sim, t), known.assumed(sim, t)) for t in (small, large, ids, *views)])
    return seen


def test_plain_views_allocate_and_know_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program run twice (its views remembered) with the views' shortcut and without it: the
    same allocations in the same order, the same values read."""
    def run() -> tuple[list[int], Any]:
        with simulated_cuda(gpu="24GiB"):
            _program()
            return _requests(monkeypatch, _program)

    with_shortcut = run()
    monkeypatch.setattr(privateuse1, "_PLAIN_VIEWS", frozenset())
    without = run()
    assert with_shortcut == without
    seen = with_shortcut[1]
    assert seen[0] == [12, 13, 14, 15, 16, 17] and seen[1] == [1, 5, 9, 13, 17, 21]
    # a view of a small unknown tensor makes it known from a placeholder (assumed); a large one stays unknown
    assert seen[4] == [(True, True), (False, False), (True, False), (True, True), (False, False), (True, False)]


def _calls() -> list[tuple[Any, Any]]:
    from collections import namedtuple

    t, u = torch.empty(2), torch.empty(3, dtype=torch.int64)
    pair = namedtuple("pair", "a b")
    return [((t, 1, 2.5, None, "mean"), {}), ((t, [t, u], (1, 2)), {"dim": 0, "out": t}),
            ((torch.Size([2, 3]), t), {}), ((t, [[1, 2], [3]]), {}), ((pair(t, 1),), {"x": {"y": t}}),
            ((torch.float16, torch.device("meta"), torch.strided, torch.contiguous_format, True, 3j), {}),
            (([t, None, u],), {"weights": (t,)}), ((), {})]


@pytest.mark.parametrize("call", range(len(_calls())))
def test_flat_maps_as_pytree(call: int) -> None:
    """`vram.run.values.flat` maps and lists what ``torch.utils._pytree`` does, in its order."""
    from torch.utils._pytree import tree_leaves, tree_map

    from vram.run.values.flat import map_call, tensors_of

    args, kwargs = _calls()[call]
    seen: list[list[Any]] = [[], []]

    def tagged(i: int) -> Any:
        def fn(x: Any) -> Any:
            seen[i].append(x)
            return ("leaf", x)
        return fn

    ours, theirs = map_call(tagged(0), args, kwargs), tree_map(tagged(1), (args, kwargs))
    assert repr(ours) == repr(theirs) and type(ours[0]) is type(theirs[0])
    assert [id(x) for x in seen[0]] == [id(x) for x in seen[1]]
    for x in (args, kwargs, *args):
        assert [id(t) for t in tensors_of(x)] == [id(t) for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def test_current_stream_of_is_current_streams_id() -> None:
    """What an allocation's stream is read as: the current stream's ``cuda_stream``, 0 by default."""
    from vram.frontend import memory

    with simulated_cuda(gpu="24GiB", device_count=2):
        assert memory.current_stream_of(0) == memory.current_stream(0).cuda_stream == 0
        side = memory.Stream(1)
        with memory.stream(side):
            assert memory.current_stream_of(1) == memory.current_stream(1).cuda_stream == side.cuda_stream != 0
            assert memory.current_stream_of(0) == 0
        assert memory.current_stream_of(1) == 0


def test_default_device_is_read_from_the_threads_own_entry() -> None:
    """The function mode reads ``set_default_device``'s context from the thread-local's own
    ``__dict__`` (a missed ``getattr`` on a ``threading.local`` costs an exception): the same
    answer as ``getattr`` in the thread that set it and in one that did not."""
    import threading

    local = torch._GLOBAL_DEVICE_CONTEXT
    seen: list[Any] = []

    def read() -> None:
        seen.append((local.__dict__.get("device_context"), getattr(local, "device_context", None)))

    try:
        read()
        torch.set_default_device("meta")
        read()
        other = threading.Thread(target=read)
        other.start()
        other.join()
    finally:
        torch.set_default_device(None)
    assert seen[0] == (None, None) and seen[2] == (None, None)
    assert seen[1][0] is not None and seen[1][0] is seen[1][1]
    with simulated_cuda(gpu="24GiB"):
        torch.set_default_device("cuda")
        try:
            x = torch.empty(4)
        finally:
            torch.set_default_device(None)
        assert x.is_cuda and active_sim().block_of(x) is not None
