"""NCCL's memory is taken from the simulated GPU when PyTorch would create or connect the
communicator, so it counts toward the card's capacity (`vram.run.distributed.nccl`).

Expected figures are hand-computed from NCCL's source as in tests/test_nccl.py (H100 SXM node,
NCCL defaults): bookkeeping (2 + 3 x 32 channels) x 2 MiB = 196 MiB when a communicator is
created; its ring 24 channels x (2 MiB send + 10 MiB receive connectors) = 288 MiB more at its
first collective (484 MiB in all); a peer 32 channels x 2 MiB (send) or x 10 MiB (receive).
When (``ProcessGroupNCCL.cpp``): lazily at the group's first operation, or at
``init_process_group(device_id=...)`` (``eagerConnectSingleDevice``). Which communicator a send
uses: the group's inside ``batch_isend_irecv`` or after an eager init, else a two-rank one of
its own ("In lazy initialization mode, this will result in a new 2-rank NCCL communicator").
``cudaMemGetInfo`` and the caching allocator's OOM see the memory: free = total - context -
this process's driver memory (NCCL's included).
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from vram.devices.gpus import resolve_gpu  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

MiB = 1 << 20
H100 = 85_017_755_648            # CUDA's total for an H100 80GB HBM3 (vram.devices.gpus)
BOOK, RING = 196 * MiB, 24 * 12 * MiB
SEND, RECV = 32 * 2 * MiB, 32 * 10 * MiB


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(k, str(v))
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TORCH_DIST_INIT_BARRIER", "LOCAL_WORLD_SIZE",
                "NCCL_BUFFSIZE", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        monkeypatch.delenv(var, raising=False)


def free() -> int:
    return int(torch.cuda.mem_get_info()[0])


def test_lazy_communicator_is_charged_at_the_first_collective_and_makes_the_allocator_oom(two_ranks: Any) -> None:
    with simulated_cuda(gpu="H100", context="500MiB", device_count=2):
        torch.cuda.set_device(0)
        assert free() == H100 - 500 * MiB
        dist.init_process_group("nccl")
        assert free() == H100 - 500 * MiB                  # lazy: no communicator yet
        x = torch.empty(256 * 1024, device="cuda")         # 1 MiB: a 2 MiB segment
        dist.all_reduce(x)
        left = H100 - 500 * MiB - 2 * MiB - BOOK - RING
        assert free() == left
        # fits the card without NCCL's 484 MiB, not with them: the caching allocator's cudaMalloc fails
        with pytest.raises(torch.OutOfMemoryError) as e:
            torch.empty(left + 100 * MiB, dtype=torch.uint8, device="cuda")
        free_text = f"{left / 2**30:.2f} GiB"
        assert f"GPU 0 has a total capacity of 79.18 GiB of which {free_text} is free" in str(e.value)
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        assert torch.empty(left - 100 * MiB, dtype=torch.uint8, device="cuda").numel() > 0
        dist.destroy_process_group()                        # ncclCommDestroy frees it
        assert free() == H100 - 500 * MiB - torch.cuda.memory_reserved()


def test_eager_init_creates_the_communicator_and_unbatched_sends_use_it(two_ranks: Any) -> None:
    with simulated_cuda(gpu="H100", device_count=2):
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
        assert free() == H100 - BOOK                      # eagerConnectSingleDevice: bookkeeping now
        t = torch.empty(256 * 1024, device="cuda")        # 1 MiB: a 2 MiB segment
        dist.send(t, 1)                                   # the group's communicator, peer 1 connected
        assert free() == H100 - 2 * MiB - BOOK - SEND


def test_batch_isend_irecv_uses_the_groups_communicator_and_one_work(two_ranks: Any) -> None:
    with simulated_cuda(gpu="H100", device_count=2):
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        a, b = torch.zeros(256 * 1024, device="cuda"), torch.empty(256 * 1024, device="cuda")  # one 2 MiB segment
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, 1), dist.P2POp(dist.irecv, b, 1)])
        assert len(works) == 1                            # _coalescing_manager: one Work for the batch
        assert free() == H100 - 2 * MiB - BOOK - SEND - RECV
        dist.send(a, 1)                                   # alone, lazy: a two-rank communicator "0:1"
        assert free() == H100 - 2 * MiB - 2 * BOOK - 2 * SEND - RECV


def test_a_communicator_that_does_not_fit_is_nccls_error_and_takes_nothing(two_ranks: Any) -> None:
    with simulated_cuda(gpu="H100", device_count=2):
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        big = torch.empty(H100 - 300 * MiB, dtype=torch.uint8, device="cuda")   # 196 MiB fit, 484 do not
        before = free()
        with pytest.raises(dist.DistBackendError, match="Cuda failure 2 'out of memory'"):
            dist.all_reduce(big[:4])
        assert free() == before
        del big
        torch.cuda.empty_cache()
        dist.all_reduce(torch.ones(4, device="cuda"))
        assert free() == H100 - 2 * MiB - BOOK - RING


def test_every_new_group_is_charged_and_gloo_has_no_communicator(two_ranks: Any) -> None:
    """A group made after another was destroyed gets its own communicator (CPython reuses the
    ``id()`` of a freed group; keyed by it, a new group found the destroyed one's and was charged
    nothing). Gloo's collectives run on the host: no NCCL communicator, nothing charged."""
    from vram.run.distributed import nccl

    with simulated_cuda(gpu="H100", device_count=2):
        torch.cuda.set_device(0)
        for _ in range(6):
            dist.init_process_group("nccl")
            t = torch.ones(4, device="cuda")
            dist.all_reduce(t)
            assert free() == H100 - 2 * MiB - BOOK - RING  # the 2 MiB segment of t, one communicator
            del t
            dist.destroy_process_group()
            torch.cuda.empty_cache()
        dist.init_process_group("gloo")
        out = torch.empty(4)
        dist.all_to_all_single(out, torch.ones(4))
        dist.destroy_process_group()
        # the rank's figure is the peak of the communicators alive together: one at a time here
        assert nccl.rank_memory(resolve_gpu("H100")).bytes == BOOK + RING
        assert nccl._MADE[0] == 6
        assert not nccl._COMMS


def test_the_rank_figure_is_the_peak_of_communicators_alive_together(two_ranks: Any) -> None:
    """Two groups alive together hold two communicators (``new_group``: a communicator of its own,
    ``ProcessGroupNCCL::getNCCLComm`` per group); destroying one gives its memory back
    (``ncclCommDestroy``) and a group made after it takes its place: the card never holds more than
    two, and the rank's figure is that peak, 2 x 484 MiB, not the 3 x 484 MiB ever created."""
    from vram.run.distributed import nccl

    with simulated_cuda(gpu="H100", device_count=2):
        torch.cuda.set_device(0)
        dist.init_process_group("nccl")
        t = torch.ones(4, device="cuda")                  # a 2 MiB segment
        dist.all_reduce(t)
        for _ in range(2):
            g = dist.new_group([0, 1])
            dist.all_reduce(t, group=g)
            assert free() == H100 - 2 * MiB - 2 * (BOOK + RING)
            dist.all_reduce(t, group=g)                   # connected: nothing more
            assert free() == H100 - 2 * MiB - 2 * (BOOK + RING)
            dist.destroy_process_group(g)
            assert free() == H100 - 2 * MiB - (BOOK + RING)
        m = nccl.rank_memory(resolve_gpu("H100"))
        assert m.bytes == 2 * (BOOK + RING)
        assert "2 communicator(s) alive together; 3 were created" in m.lines[-1]
        dist.destroy_process_group()
        assert free() == H100 - 2 * MiB
        assert nccl.rank_memory(resolve_gpu("H100")).bytes == 2 * (BOOK + RING)
