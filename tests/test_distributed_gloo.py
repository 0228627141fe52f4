"""Gloo in a simulated run (`vram.run.distributed.gloo`): ``"cpu:gloo,cuda:nccl"`` and ``"gloo"``
build at once (a real ``ProcessGroupGloo`` connects to every other rank's process, which no
rank answers here), and host collectives compute their values as if every rank held this
rank's, as the simulated NCCL group does."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from vram.run.runtime import simulated_cuda  # noqa: E402


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(k, str(v))


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "gloo"])
def test_gloo_builds_and_computes_host_values(two_ranks: Any, backend: str) -> None:
    with simulated_cuda(gpu="24GiB"):
        dist.init_process_group(backend)
        t = torch.tensor([1.0, 2.0])
        dist.all_reduce(t)                                  # SUM over 2 equal contributions
        assert t.tolist() == [2.0, 4.0]
        outs = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(outs, torch.tensor([3.0, 4.0]))
        assert [o.tolist() for o in outs] == [[3.0, 4.0]] * 2
        objs: list[Any] = [None, None]
        dist.all_gather_object(objs, {"rank": dist.get_rank()}, group=dist.new_group(backend="gloo"))
        assert objs == [{"rank": 1}, {"rank": 1}]
        dist.barrier()   # distributed_c10d.barrier: the object-collective device is cpu, so gloo's
        assert torch.cuda.max_memory_allocated() == 0


def test_gloo_refuses_cuda_tensors_clearly(two_ranks: Any) -> None:
    with simulated_cuda(gpu="24GiB"):
        dist.init_process_group("gloo")
        with pytest.raises(NotImplementedError, match="gloo's all_reduce on a CUDA tensor is not simulated"):
            dist.all_reduce(torch.ones(2, device="cuda"))


def test_a_collectives_error_is_not_buried_by_the_nccl_version_lookup(two_ranks: Any) -> None:
    """``c10d_logger``'s wrapper asks ``torch.cuda.nccl.version()`` (absent from a CPU build) for
    its debug log when a collective raises; the collective's own error must be what surfaces."""
    with simulated_cuda(gpu="24GiB"):
        dist.init_process_group("nccl")
        with pytest.raises(TypeError, match="incompatible function arguments"):
            dist.all_reduce(torch.ones(2, device="cuda"), op="bogus")
