"""Values a simulated run knows exactly.

Tensors built by factories or from host data, and small ops on such tensors alone, have the
values PyTorch computes: the expectations below are the same expressions evaluated by torch on
the CPU, so that control flow takes the GPU's branch (an all-ones attention mask gives
``mask.all() == True``). Values that need the model's arithmetic stay unknown.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from vram.run.runtime import DataDependentError, simulated_cuda  # noqa: E402
from vram.run.values.known import VALUE_LIMIT  # noqa: E402
from vram.run.values.limits import DERIVED_LIMIT  # noqa: E402


def test_all_ones_attention_mask_is_all_ones() -> None:
    with simulated_cuda():
        mask = torch.ones(4, 128, dtype=torch.long, device="cuda")
        assert bool(mask.all()) is True and mask.all().item() is True
        assert (mask == 1).all()  # Hugging Face's "no padding: drop the mask" test
        assert int(mask.sum()) == 512


def test_padded_mask_lengths_positions_and_indexing() -> None:
    host = [[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]]
    expected = torch.tensor(host)
    with simulated_cuda():
        ids = torch.tensor(host, device="cuda")
        pad = ids.eq(0)
        assert pad.any().item() is True
        assert (~pad).sum(-1).tolist() == (~expected.eq(0)).sum(-1).tolist() == [3, 2]
        positions = (~pad).long().cumsum(-1) - 1
        assert positions.tolist() == ((~expected.eq(0)).long().cumsum(-1) - 1).tolist()
        assert torch.isin(ids, torch.tensor([5, 3], device="cuda")).tolist() == \
            torch.isin(expected, torch.tensor([5, 3])).tolist()


def test_data_dependent_ops_get_their_real_output_size() -> None:
    host = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]])
    with simulated_cuda():
        ids = host.to("cuda")
        before = torch.cuda.memory_allocated()
        nz = torch.nonzero(ids)
        assert nz.shape == torch.nonzero(host).shape == (5, 2) and nz.is_cuda
        assert torch.cuda.memory_allocated() - before == 512  # 5 x 2 int64 = 80 B: one 512 B block
        assert nz.tolist() == torch.nonzero(host).tolist()
        assert ids[ids > 2].tolist() == host[host > 2].tolist() == [3, 4, 5]


def test_host_copies_and_printing() -> None:
    with simulated_cuda():
        x = torch.arange(6, device="cuda", dtype=torch.float32).view(2, 3)
        c = x.cpu()
        assert c.device.type == "cpu" and c.tolist() == [[0, 1, 2], [3, 4, 5]]
        c.zero_()  # a copy: the simulated tensor's values do not change
        assert x.sum().item() == 15.0
        assert x.to("cpu", torch.int64).dtype == torch.int64
        assert x.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]
        assert repr(x) == "tensor([[0., 1., 2.],\n        [3., 4., 5.]], device='cuda:0')"
        assert repr(x.int()) == ("tensor([[0, 1, 2],\n        [3, 4, 5]], device='cuda:0', "
                                 "dtype=torch.int32)")
        assert f"{x.sum():.1f}" == "15.0"
        assert torch.from_numpy(np.array([7, 8])).cuda().tolist() == [7, 8]


def test_in_place_updates_follow_and_unknown_inputs_poison() -> None:
    with simulated_cuda(strict_values=True):
        x = torch.zeros(4, device="cuda")
        x[1] = 5
        x.add_(1)
        assert x.tolist() == [1.0, 6.0, 1.0, 1.0]
        unknown = torch.randn(512, 512, device="cuda").sum()  # 262,144 elements: not kept
        x.add_(unknown)
        with pytest.raises(DataDependentError):
            x.tolist()


def test_values_are_kept_up_to_the_limit() -> None:
    with simulated_cuda(strict_values=True):
        at_limit = torch.ones(VALUE_LIMIT, device="cuda")
        assert at_limit.sum().item() == VALUE_LIMIT
        over = torch.ones(VALUE_LIMIT + 1, device="cuda")
        with pytest.raises(DataDependentError):
            over.sum().item()
        with pytest.raises(DataDependentError):
            torch.empty(4, device="cuda").tolist()  # uninitialized memory has no values


def test_constants_derived_from_known_values_are_kept_up_to_the_derived_limit() -> None:
    """A deterministic op whose inputs are all known keeps outputs up to `DERIVED_LIMIT` elements
    (rotary tables, a window expanded over frames); factories, random draws and anything with an
    unknown input keep `VALUE_LIMIT`."""
    with simulated_cuda(strict_values=True):
        pos = torch.arange(4096, device="cuda", dtype=torch.float32)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, device="cuda", dtype=torch.float32) / 64))
        table = torch.outer(pos, inv_freq).cos()   # 131,072 elements: over VALUE_LIMIT, known
        ref = torch.outer(torch.arange(4096, dtype=torch.float32),
                          1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).cos()
        assert table.numel() > VALUE_LIMIT and table.sum().item() == ref.sum().item()
        row = torch.ones(1024, device="cuda")
        at = row.expand(DERIVED_LIMIT // 1024, 1024).contiguous()
        assert at.sum().item() == DERIVED_LIMIT
        over = row.expand(DERIVED_LIMIT // 1024 + 1, 1024).contiguous()
        with pytest.raises(DataDependentError):
            over.sum().item()
        drawn = torch.rand(4, device="cuda").expand(VALUE_LIMIT, 4).contiguous()  # a draw, then derived: kept
        assert drawn.sum().item() > 0
        with pytest.raises(DataDependentError):
            torch.rand(VALUE_LIMIT + 1, device="cuda").sum().item()  # a random op keeps VALUE_LIMIT


def test_random_factories_leave_the_cpu_random_stream_alone() -> None:
    torch.manual_seed(0)
    reference = torch.rand(3)
    with simulated_cuda():
        torch.manual_seed(0)
        ids = torch.randint(0, 100, (2, 8), device="cuda")
        assert all(0 <= v < 100 for row in ids.tolist() for v in row)
        assert torch.equal(torch.rand(3), reference)  # the script's CPU randomness is unchanged


def test_knowing_values_allocates_nothing_more() -> None:
    """The CPU copies are host memory: the simulated GPU's figures are the same with them."""
    with simulated_cuda():
        mask = torch.ones(8, 1024, dtype=torch.bool, device="cuda")
        a0 = torch.cuda.memory_allocated()
        keep = mask.all()
        assert torch.cuda.memory_allocated() - a0 == 512  # the 0-dim bool result's block
        assert keep.item() is True


def test_overwriting_in_place_ops_define_values_partial_writes_do_not() -> None:
    with simulated_cuda(strict_values=True):
        e = torch.empty(3, device="cuda")
        e.fill_(2)  # every element written: known, whatever empty() held
        assert e.tolist() == [2.0, 2.0, 2.0]
        f = torch.empty(4, device="cuda")
        f.copy_(torch.arange(4.0, device="cuda"))
        assert f.tolist() == [0.0, 1.0, 2.0, 3.0]
        g = torch.empty(4, device="cuda")
        g[:2].fill_(1)  # half of an uninitialized storage: the other half is still unknown
        with pytest.raises(DataDependentError):
            g.tolist()
        g[2:].copy_(torch.tensor([5.0, 6.0], device="cuda"))   # the other half: now every byte is written
        assert g.tolist() == [1.0, 1.0, 5.0, 6.0]
        h = torch.empty(4, device="cuda")
        h[:2].fill_(1)
        h.mul_(torch.randn(4, device="cuda").exp())   # an unknown write in between forgets the piece
        h[2:].fill_(3)
        with pytest.raises(DataDependentError):
            h.tolist()


def test_a_grown_storage_keeps_its_bytes_and_a_kept_size_its_values() -> None:
    """``resize_`` copies the old bytes into the grown storage (``resize_bytes_cuda``), as
    ``all_gather_object`` relies on when it pads its pickled bytes to the largest rank's size."""
    with simulated_cuda():
        t = torch.tensor([7, 8, 9], dtype=torch.uint8, device="cuda")
        t.resize_(3)
        assert t.tolist() == [7, 8, 9]
        t.resize_(5)
        assert t[:3].tolist() == [7, 8, 9] and t.shape == (5,)
