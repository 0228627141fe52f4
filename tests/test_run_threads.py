"""Simulated CUDA on every thread and in every finalizer, as on a GPU.

On a GPU a ``threading.Thread`` (a data loader's pin-memory thread, a prefetcher, an asynchronous
checkpoint writer) and a ``__del__`` run by Python's cyclic collector allocate CUDA memory as the
main thread does; each thread has its own current device, starting at 0 (``cudaSetDevice`` is per
host thread). Under the simulation the same must hold, and the books must balance: memory
allocated equals the live tensors' blocks, nothing leaked or freed twice.
"""
from __future__ import annotations

import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from vram.run.runtime import simulated_cuda  # noqa: E402


def r512(n: int) -> int:
    return -(-n // 512) * 512


def _in_thread(fn: Any) -> Any:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread's assertion
            out["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_thread_allocates_on_the_simulated_gpu() -> None:
    with simulated_cuda():
        made = _in_thread(lambda: [torch.empty(1000, device="cuda"), torch.ones(10).cuda(),
                                   torch.zeros(3).to("cuda"), torch.randn(4, 4, device="cuda") * 2])
        assert [t.device for t in made] == [torch.device("cuda", 0)] * 4
        assert all(t.is_cuda for t in made)
        assert torch.cuda.memory_allocated() == r512(4000) + 3 * 512
        del made
        assert torch.cuda.memory_allocated() == 0


def test_a_thread_pool_and_a_subclassed_thread() -> None:
    class Writer(threading.Thread):
        def run(self) -> None:
            self.t = torch.empty(256, 256, device="cuda")

    with simulated_cuda():
        with ThreadPoolExecutor(4) as pool:
            ts = list(pool.map(lambda n: torch.empty(n, 1024, device="cuda"), range(1, 9)))
        w = Writer()
        w.start()
        w.join()
        assert w.t.is_cuda and all(t.is_cuda for t in ts)
        assert torch.cuda.memory_allocated() == sum(n * 4096 for n in range(1, 9)) + 256 * 256 * 4
        del ts, w
        assert torch.cuda.memory_allocated() == 0


def test_threads_allocating_at_once_keep_the_books() -> None:
    keep: list[Any] = []
    lock = threading.Lock()

    def work(seed: int) -> None:
        for i in range(200):
            t = torch.empty(1 + (seed * 7919 + i * 104729) % 50000, device="cuda")
            if i % 3 == 0:
                with lock:
                    keep.append(t)
            del t

    with simulated_cuda():
        threads = [threading.Thread(target=work, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(keep) == 6 * 67
        assert torch.cuda.memory_allocated() == sum(r512(t.numel() * 4) for t in keep)
        keep.clear()
        assert torch.cuda.memory_allocated() == 0
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0


def test_each_thread_has_its_own_current_device() -> None:
    with simulated_cuda(device_count=2):
        torch.cuda.set_device(1)
        index, there = _in_thread(lambda: (torch.cuda.current_device(), torch.empty(1000, device="cuda")))
        assert index == 0 and there.device == torch.device("cuda", 0)  # a new thread starts on device 0
        assert torch.cuda.current_device() == 1
        here = torch.empty(1, device="cuda")
        assert here.device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(0) == 4096 and torch.cuda.memory_allocated(1) == 512


class _Cycle:
    """An object in a reference cycle whose finalizer allocates on the GPU."""

    kept: list[Any] = []
    failures: list[BaseException] = []

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        try:
            _Cycle.kept.append(torch.empty(64, device="cuda"))
        except BaseException as e:  # noqa: BLE001 - counted by the test
            _Cycle.failures.append(e)


@pytest.fixture
def frequent_collections() -> Any:
    old = gc.get_threshold()
    gc.set_threshold(5, 1, 1)  # collections inside the engine's own code, not only between ops
    _Cycle.kept.clear()
    _Cycle.failures.clear()
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.collect()
        _Cycle.kept.clear()


def test_a_finalizer_run_by_the_collector_allocates(frequent_collections: Any) -> None:
    with simulated_cuda():
        x = torch.randn(8, 8, device="cuda")
        for _ in range(300):
            _Cycle()
            x = torch.relu(x @ x)
        gc.collect()
        assert _Cycle.failures == []
        assert len(_Cycle.kept) == 300 and all(t.is_cuda for t in _Cycle.kept)
        live = 300 * 512 + 512  # the finalizers' tensors and x, one block of 512 bytes each
        workspace = torch.cuda.memory_allocated() - live  # cuBLAS's, allocated by the first mm
        assert workspace in (0, 32 << 20, 4 << 20)
        _Cycle.kept.clear()
        assert torch.cuda.memory_allocated() == 512 + workspace


def test_a_snapshot_while_the_collector_frees(frequent_collections: Any) -> None:
    class Holder:
        def __init__(self) -> None:
            self.me = self
            self.t = torch.empty(256, device="cuda")

    with simulated_cuda():
        torch.cuda.memory._record_memory_history(max_entries=100_000)
        try:
            for _ in range(40):
                for _ in range(20):
                    Holder()
                snap = torch.cuda.memory._snapshot()  # "deque mutated during iteration" once
                assert snap["device_traces"][0]
            gc.collect()
            snap = torch.cuda.memory._snapshot()
            events = snap["device_traces"][0]
            allocs = sum(1 for e in events if e["action"] == "alloc")
            frees = sum(1 for e in events if e["action"] == "free_completed")
            assert allocs == frees == 800  # each block freed exactly once
            assert torch.cuda.memory_allocated() == 0
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
