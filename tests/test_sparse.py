"""Sparse tensors on the simulated GPU, charged as CUDA allocates them (`vram.run.kernels.sparse`).

Expected bytes come from PyTorch's CUDA source (paths under ``aten/src/ATen/native``):
``sparse/cuda/SparseCUDATensor.cu`` (``_coalesce_sparse_cuda``), ``sparse/cuda/SparseCUDATensorMath.cu``
(``s_addmm_out_sparse_dense_cuda`` and its workers), ``sparse/SparseTensorMath.cpp`` (``_sparse_mm``),
``SparseTensorUtils.cpp`` / ``sparse/FlattenIndicesCommon.h`` (``flatten_indices``), ``TensorShape.cpp``
(``transpose`` / ``sparse_transpose_`` of a sparse tensor), ``sparse/SparseTensor.cpp``
(``clone_sparse``, ``sparse_to_dense``) and ``FunctionsManual.cpp`` (``mm_mat2_backward``'s general
path: ``mat1.t().conj().mm(grad)``). Sizes in the traces are the requested bytes.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from traced import allocator_events  # noqa: E402
from vram.run.kernels import sparse as rules  # noqa: E402
from vram.run.runtime import active_sim, run_script, simulated_cuda  # noqa: E402

warnings.filterwarnings("ignore", "Sparse invariant checks")
_CORPUS = Path(__file__).parent / "corpus"


def _trace(fn) -> list[tuple[str, int]]:  # type: ignore[no-untyped-def]
    return allocator_events(fn, stop=True)


def _notes(text: str) -> int:
    sim = active_sim()
    assert sim is not None
    return sim.uncharged.get(text, 0)


def _round(n: int) -> int:
    return max(512, -(-n // 512) * 512)


def test_coo_tensor_made_on_or_moved_to_the_gpu_owns_its_indices_and_values() -> None:
    """``sparse_coo_tensor(..., device="cuda")`` and ``.cuda()``: an int64 ``[2, nnz]`` indices
    storage and a ``[nnz]`` values storage on the GPU, nothing else."""
    i = torch.stack([torch.arange(1000) % 30, torch.arange(1000) % 20])
    with simulated_cuda(gpu="H200"):
        s = torch.sparse_coo_tensor(i, torch.ones(1000), (30, 20), device="cuda")
        assert s.is_cuda and s.device == torch.device("cuda", 0) and s.layout == torch.sparse_coo
        assert torch.cuda.memory_allocated() == _round(2 * 1000 * 8) + _round(1000 * 4)
        moved = torch.sparse_coo_tensor(i, torch.ones(1000, dtype=torch.float64), (30, 20)).cuda()
        assert moved.is_cuda and moved._values().dtype == torch.float64
        assert torch.cuda.memory_allocated() == 2 * _round(16000) + _round(4000) + _round(8000)


def test_coalesce_allocates_cudas_temporaries_and_keeps_the_distinct_entries() -> None:
    """``_coalesce_sparse_cuda`` on 1000 entries over 60 distinct (row, col) pairs: the flattened
    indices (``arange(nnz)`` int64), ``origIndices`` and ``uniqueOffsets`` (int64), then
    ``newValues`` [60] float32 and ``newIndices`` [2, 60] int64; the three nnz-sized buffers die
    on return; Thrust's sort/unique storage is named, not charged."""
    i = torch.stack([torch.arange(1000) % 30, torch.arange(1000) % 20])
    with simulated_cuda(gpu="H200"):
        s = torch.sparse_coo_tensor(i, torch.ones(1000), (30, 20), device="cuda")
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(s.coalesce()))
        assert ev == [("alloc", 8000)] * 3 + [("alloc", 60 * 4), ("alloc", 2 * 60 * 8)] + [("free_completed", 8000)] * 3
        c = keep[0]
        assert c.is_coalesced() and c._nnz() == 60
        host = torch.sparse_coo_tensor(i, torch.ones(1000), (30, 20)).coalesce()
        assert c.indices().cpu().tolist() == host.indices().tolist()
        assert c.values().cpu().tolist() == host.values().tolist()
        assert _notes(rules.THRUST_NOTE) == 1


def _coalesced(device: str = "cuda") -> torch.Tensor:
    rows, cols = torch.arange(1000) // 16, (torch.arange(1000) * 7) % 128   # 1000 distinct entries of 64 x 128
    return torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.ones(1000), (64, 128), device=device).coalesce()


@pytest.mark.parametrize("matmul", [torch.spmm, torch.sparse.mm, torch.mm, lambda a, b: a @ b])
def test_sparse_times_dense_follows_the_cusparse_path(matmul) -> None:  # type: ignore[no-untyped-def]
    """``_sparse_mm``: ``zeros(m, n)``; ``s_addmm_out_sparse_dense_cuda``: the result resized to
    [m, n]; ``_to_csr_int``: row pointers int32 [m + 1], the rows as int32 (dies at once); the
    columns as int32; a column-major clone of the row-major result; cuSPARSE SpMM (its buffer
    named); the clone, columns and row pointers die, then ``zeros`` when ``_sparse_mm`` returns."""
    with simulated_cuda(gpu="H200"):
        s, d = _coalesced(), torch.randn(128, 32, device="cuda")
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(matmul(s, d)))
        mn = 64 * 32 * 4
        assert ev == [("alloc", mn), ("alloc", mn), ("alloc", 65 * 4), ("alloc", 4000), ("free_completed", 4000),
                      ("alloc", 4000), ("alloc", mn), ("free_completed", mn), ("free_completed", 4000),
                      ("free_completed", 65 * 4), ("free_completed", mn)]
        assert keep[0].shape == (64, 32) and keep[0].layout == torch.strided
        assert _notes(rules.SPMM_NOTE) == 1


def test_sparse_times_dense_gives_the_product_when_values_are_known() -> None:
    host = torch.arange(128 * 32, dtype=torch.float32).view(128, 32)
    with simulated_cuda(gpu="H200"):
        got = torch.sparse.mm(_coalesced(), host.cuda()).cpu()
    assert torch.equal(got, torch.sparse.mm(_coalesced("cpu"), host))


def test_backward_to_the_dense_operand_transposes_and_coalesces() -> None:
    """``mm_mat2_backward``: ``mat1.t()`` clones the sparse tensor (``clone_sparse``: values then
    indices) and swaps its index rows through ``zeros_like(row0)``; the transpose is uncoalesced,
    so its ``mm`` coalesces it (1000 distinct entries) inside ``s_addmm_out_sparse_dense_cuda``
    (after the result, before the CSR conversion); the gradient [128, 32] is all that stays."""
    with simulated_cuda(gpu="H200"):
        s = _coalesced()
        d = torch.randn(128, 32, device="cuda", requires_grad=True)
        y = torch.sparse.mm(s, d)
        g = torch.ones(64, 32, device="cuda")
        before = torch.cuda.memory_allocated()
        ev = _trace(lambda: y.backward(g))
        kn = 128 * 32 * 4
        assert ev == [("alloc", 4000), ("alloc", 16000), ("alloc", 8000), ("free_completed", 8000),
                      ("alloc", kn), ("alloc", kn),
                      ("alloc", 8000), ("alloc", 8000), ("alloc", 8000), ("alloc", 4000), ("alloc", 16000),
                      ("free_completed", 8000), ("free_completed", 8000), ("free_completed", 8000),
                      ("alloc", 129 * 4), ("alloc", 4000), ("free_completed", 4000), ("alloc", 4000), ("alloc", kn),
                      ("free_completed", kn), ("free_completed", 4000), ("free_completed", 129 * 4),
                      ("free_completed", 4000), ("free_completed", 16000), ("free_completed", kn),
                      ("free_completed", 4000), ("free_completed", 16000)]
        assert d.grad is not None and d.grad.shape == (128, 32)
        assert torch.cuda.memory_allocated() == before + kn


def test_to_dense_sum_scale_and_components() -> None:
    """``sparse_to_dense``: ``zeros(sizes)`` then ``add_`` of a coalesced tensor, one kernel;
    ``values()``/``indices()`` are views of the components; ``* 2`` makes new values only."""
    with simulated_cuda(gpu="H200"):
        s = _coalesced()
        ev = _trace(lambda: s.to_dense())
        assert ev == [("alloc", 64 * 128 * 4), ("free_completed", 64 * 128 * 4)]
        dense = s.to_dense()
        assert torch.equal(dense.cpu(), _coalesced("cpu").to_dense())
        assert s.values().data_ptr() == s._values().data_ptr() and s.indices().shape == (2, 1000)
        base = torch.cuda.memory_allocated()
        doubled = s * 2
        assert doubled.layout == torch.sparse_coo and float(torch.sparse.sum(doubled)) == 2000.0
        assert torch.cuda.memory_allocated() >= base + _round(4000)
        assert s.t().shape == (128, 64)


def test_csr_tensor_owns_its_three_component_storages() -> None:
    crow, col = torch.tensor([0, 2, 3]), torch.tensor([0, 2, 1])
    with simulated_cuda(gpu="H200"):
        c = torch.sparse_csr_tensor(crow, col, torch.ones(3), (2, 3), device="cuda")
        assert c.layout == torch.sparse_csr and c.is_cuda
        assert torch.cuda.memory_allocated() == 3 * 512
        assert c.to_dense().cpu().tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]


@pytest.mark.parametrize("op, name", [
    (lambda s, d: s * s, "aten::mul"),
    (lambda s, d: torch.sparse.softmax(s, 0), "aten::_sparse_softmax"),
    (lambda s, d: torch.bmm(s.unsqueeze(0), d.unsqueeze(0)), "aten::bmm"),
    (lambda s, d: s.to_sparse_bsc((4, 4)).to_sparse_bsr((4, 4)), "aten::_to_sparse_bsr"),
])
def test_sparse_ops_with_kernels_of_their_own_stop_with_one_line(op, name) -> None:  # type: ignore[no-untyped-def]
    with simulated_cuda(gpu="H200"):
        s, d = _coalesced(), torch.randn(128, 4, device="cuda")
        with pytest.raises(NotImplementedError, match=rf"^vram run: {name} on a sparse \(sparse_\w+\) tensor on the "
                                                      r"simulated GPU is not modelled") as e:
            op(s, d)
        assert "\n" not in str(e.value)


def test_pygcn_trains_to_its_end(capsys: pytest.CaptureFixture[str]) -> None:
    """The pygcn-style GCN (tests/corpus/gcn_pygcn.py) trains five epochs. What stays allocated
    at the end: the two cuBLAS workspaces of sm90 (32 MiB each: forward thread and autograd
    thread), the features, the adjacency's indices and values, labels and training ids, the four
    parameters, their gradients and Adam's two moments (its ``step`` stays on the CPU), and the
    last epoch's output [2708, 7] and loss."""
    pytest.importorskip("scipy")
    status = run_script(str(_CORPUS / "gcn_pygcn.py"), [], gpu="H200")
    out = capsys.readouterr().out
    assert status == 0
    lines = out.splitlines()
    assert [ln.split(":")[0] for ln in lines[:5]] == [f"epoch {e}" for e in range(1, 6)]
    import importlib.util
    spec = importlib.util.spec_from_file_location("gcn_pygcn", _CORPUS / "gcn_pygcn.py")
    assert spec is not None and spec.loader is not None
    gcn = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gcn)
    adj, features, labels = gcn.load_data()
    nnz = adj._nnz()
    assert lines[0] == f"epoch 1: nnz {nnz}"
    params = [1433 * 16 * 4, 16 * 4, 16 * 7 * 4, 7 * 4]
    expected = (2 * 32 * 1024 * 1024 + _round(2708 * 1433 * 4) + _round(2 * nnz * 8) + _round(nnz * 4)
                + _round(2708 * 8) + _round(140 * 8) + 4 * sum(_round(p) for p in params)
                + _round(2708 * 7 * 4) + _round(4))
    assert lines[5].startswith(f"allocated {expected} ")


def _csr_dense() -> torch.Tensor:
    return (torch.arange(64 * 128).view(64, 128) % 9 == 0).float()   # 911 entries of 64 x 128


def test_csr_times_dense_follows_spmm() -> None:
    """``_sparse_csr_mm``: ``zeros(m, n)``; ``addmm_out_sparse_compressed_cuda``: the result
    (``empty({0, 0})``) resized to [m, n] and copied from it; ``spmm``: the row-major result and
    ``mat2`` are BLAS-compatible, so no copies; cuSPARSE's SpMM buffer named; ``zeros`` dies."""
    host = torch.arange(128 * 32, dtype=torch.float32).view(128, 32)
    with simulated_cuda(gpu="H200"):
        c, d = _csr_dense().to_sparse_csr().cuda(), host.cuda()
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(c @ d))
        assert ev == [("alloc", 64 * 32 * 4), ("alloc", 64 * 32 * 4), ("free_completed", 64 * 32 * 4)]
        assert torch.equal(keep[0].cpu(), _csr_dense() @ host)
        assert _notes(rules.SPMM_NOTE) == 1


def test_bsr_times_dense_follows_block_sparse_mm() -> None:
    """``block_sparse_mm`` (4 x 4 blocks): after ``zeros`` and the result, a column-major clone of
    the row-major result (``cloneBatchedColumnMajor``), the row pointers [16 + 1] and block columns
    [512] as int32 for ``bsrmm``, which die first; the clone is copied back and dies, then ``zeros``."""
    host = torch.arange(128 * 32, dtype=torch.float32).view(128, 32)
    with simulated_cuda(gpu="H200"):
        b, d = _csr_dense().to_sparse_bsr((4, 4)).cuda(), host.cuda()
        assert b._nnz() == 512
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(b @ d))
        mn = 64 * 32 * 4
        assert ev == [("alloc", mn), ("alloc", mn), ("alloc", mn), ("alloc", 17 * 4), ("alloc", 512 * 4),
                      ("free_completed", 512 * 4), ("free_completed", 17 * 4), ("free_completed", mn),
                      ("free_completed", mn)]
        assert torch.equal(keep[0].cpu(), _csr_dense() @ host)


def test_index_select_along_a_sparse_dim_follows_cudas_kernel() -> None:
    """``index_select_sparse_cuda``, dim 0 of a coalesced tensor (no sort), index [3, 5, -1, 3]
    (16 entries per row: 48 selected): ``nneg_index``, ``arange(4)``, ``arange(nnz)``, the match
    counts and first matches (int64 [4] each), their ``sum`` (8 B, read and freed), the result rows
    and selected entries (int64 [48] each), the counts' ``cumsum`` and a one-element dummy (freed in
    reverse), the result's indices [2, 48] and values [48]; then the block's locals die in reverse."""
    rows, cols = torch.arange(1000) // 16, (torch.arange(1000) * 7) % 128
    host = torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.arange(1000.0), (64, 128)).coalesce()
    index = torch.tensor([3, 5, -1, 3])
    with simulated_cuda(gpu="H200"):
        s, i = host.cuda(), index.cuda()
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(s.index_select(0, i)))
        assert ev == [("alloc", 32), ("alloc", 32), ("alloc", 8000), ("alloc", 32), ("alloc", 32),
                      ("alloc", 8), ("free_completed", 8), ("alloc", 384), ("alloc", 384), ("alloc", 32),
                      ("alloc", 8), ("free_completed", 8), ("free_completed", 32), ("alloc", 2 * 48 * 8),
                      ("alloc", 48 * 4), ("free_completed", 384), ("free_completed", 384), ("free_completed", 32),
                      ("free_completed", 32), ("free_completed", 8000), ("free_completed", 32), ("free_completed", 32)]
        got = keep[0].cpu()
    assert got._nnz() == 48 and torch.equal(got.to_dense(), host.index_select(0, index).to_dense())


def test_gradient_to_sparse_values_masks_the_sparse_gradient() -> None:
    """A sparse tensor made from values that require grad: the gradient of its values is
    ``grad.sparse_mask(result)._values()`` (derivatives.yaml), where ``grad`` is sparse and
    coalesced; CUDA's intersection kernel (SparseBinaryOpIntersectionCommon.h): ``arange(nnz)``,
    the gradient's hashes ``empty(nnz)`` (int64), the intersection buffer [2, nnz] (int64), a
    one-element dummy, the mask's indices cloned, the result values; the buffer, hashes and
    arange die. Both gradients match the CPU's."""
    rows, cols = torch.arange(1000) // 16, (torch.arange(1000) * 7) % 128
    indices, dense = torch.stack([rows, cols]), torch.arange(128 * 32, dtype=torch.float32).view(128, 32)
    values_cpu, dense_cpu = torch.arange(1000.0).requires_grad_(), dense.clone().requires_grad_()
    torch.sparse.mm(torch.sparse_coo_tensor(indices, values_cpu, (64, 128)), dense_cpu).sum().backward()
    with simulated_cuda(gpu="H200"):
        values, d = torch.arange(1000.0).cuda().requires_grad_(), dense.cuda().requires_grad_()
        y = torch.sparse.mm(torch.sparse_coo_tensor(indices.cuda(), values, (64, 128)), d)
        ev = _trace(lambda: y.sum().backward())
        mask = [("alloc", 8000), ("alloc", 8000), ("alloc", 16000), ("alloc", 8), ("free_completed", 8),
                ("alloc", 16000), ("alloc", 4000), ("free_completed", 16000), ("free_completed", 8000),
                ("free_completed", 8000)]
        assert any(ev[i:i + len(mask)] == mask for i in range(len(ev)))
        assert values.grad is not None and d.grad is not None
        assert torch.equal(values.grad.cpu(), values_cpu.grad) and torch.equal(d.grad.cpu(), dense_cpu.grad)


def test_sparse_plus_sparse_concatenates_as_cuda_does() -> None:
    """``add_out_sparse_cuda``: the indices and values concatenated (``cat``), uncoalesced; with
    ``alpha`` the second values are scaled first (a copy, dying on return); when the entries
    outnumber the elements the result is coalesced and takes the coalesced components."""
    rows, cols = torch.arange(1000) // 16, (torch.arange(1000) * 7) % 128
    host = torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.arange(1000.0), (64, 128))
    small = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [0, 0, 1]]), torch.ones(3), (2, 2))
    with simulated_cuda(gpu="H200"):
        s, t = host.cuda(), small.cuda()
        keep: list[torch.Tensor] = []
        assert _trace(lambda: keep.append(s + s)) == [("alloc", 2 * 2000 * 8), ("alloc", 2000 * 4)]
        assert _trace(lambda: keep.append(s.add(s, alpha=2))) == [
            ("alloc", 4000), ("alloc", 2 * 2000 * 8), ("alloc", 2000 * 4), ("free_completed", 4000)]
        assert not keep[0].is_coalesced() and keep[0]._nnz() == 2000
        ev = _trace(lambda: keep.append(t + t))   # 6 entries > 4 elements: coalesced into 2
        assert ev == [("alloc", 96), ("alloc", 24), ("alloc", 48), ("alloc", 48), ("alloc", 48), ("alloc", 8),
                      ("alloc", 32), ("free_completed", 48), ("free_completed", 48), ("free_completed", 48),
                      ("free_completed", 96), ("free_completed", 24)]
        assert keep[2].is_coalesced() and keep[2].cpu().to_dense().tolist() == [[4.0, 0.0], [0.0, 2.0]]
        assert torch.equal(keep[1].cpu().to_dense(), host.add(host, alpha=2).to_dense())


def test_sparse_sum_backward_along_one_sparse_dim() -> None:
    """``_sparse_sum_backward_cuda`` for ``torch.sparse.sum(a, [1])`` of an uncoalesced [64, 128]
    tensor with 1000 entries over 63 rows: the input coalesced (three int64 [nnz] buffers, values,
    indices), the gradient values ``empty_like(values)``, the gradient's indices flattened
    (``zeros(63)``), the input's over the kept dim (``zeros(nnz)``), the lower-bound positions
    (``empty_like``), those three freed in reverse, then the indices cloned. Its gradient matches the CPU's."""
    rows, cols = torch.arange(1000) // 16, (torch.arange(1000) * 7) % 128
    indices = torch.stack([rows, cols])
    values_cpu = torch.arange(1000.0).requires_grad_()
    torch.sparse.sum(torch.sparse_coo_tensor(indices, values_cpu, (64, 128)), [1]).to_dense().pow(2).sum().backward()
    with simulated_cuda(gpu="H200"):
        values = torch.arange(1000.0).cuda().requires_grad_()
        loss = torch.sparse.sum(torch.sparse_coo_tensor(indices.cuda(), values, (64, 128)), [1]).to_dense().pow(2).sum()
        ev = _trace(lambda: loss.backward())
        step = [("alloc", 8000)] * 3 + [("alloc", 4000), ("alloc", 16000)] + [("free_completed", 8000)] * 3 + [
            ("alloc", 4000), ("alloc", 63 * 8), ("alloc", 8000), ("alloc", 8000), ("free_completed", 8000),
            ("free_completed", 8000), ("free_completed", 63 * 8), ("alloc", 16000)]
        assert any(ev[i:i + len(step)] == step for i in range(len(ev)))
        assert values.grad is not None and torch.equal(values.grad.cpu(), values_cpu.grad)


def test_half_sparse_matmul_fails_as_on_cuda() -> None:
    """``s_addmm_out_csr_sparse_dense_cuda_worker`` dispatches on floating and complex types only."""
    rows, cols = torch.arange(1000) // 16, (torch.arange(1000) * 7) % 128
    with simulated_cuda(gpu="H200"):
        s = torch.sparse_coo_tensor(torch.stack([rows, cols]), torch.ones(1000), (64, 128)).cuda().half()
        with pytest.raises(RuntimeError, match=r"^\"addmm_sparse_cuda\" not implemented for 'Half'$"):
            torch.sparse.mm(s, torch.ones(128, 2, device="cuda", dtype=torch.half))


def test_csc_to_csr_flips_as_sparse_compressed_to_flipped() -> None:
    """``sparse_compressed_to_flipped`` for a 64 x 128 CSC tensor with 910 entries (int64 indices), what autograd's
    ``t()`` of a CSR matrix needs before its matmul: the batch offset (8 B, its ``cumsum`` 8 B; the first
    dies), the 128 column offsets plus it (1024 B) copied into ``empty(129)`` (1032 B; the sum dies), the COO
    indices [2, 910], the batches (``div``, 7280 B) and their scaled copy (dies at once; then the batches
    die), the hashes (``arange``), ``sort`` (values and indices, then ``fillSliceWithIndex``'s int64
    ``arange`` of the 910 keys, a small-sort slice: tests/test_sorting_kernels.py; the range dies on return,
    the values at once), the sorted COO indices [2, 910] and values [910], the row pointers [65] spread into
    ``zeros`` [1, 65] through a [1, 64] difference (dies, then the pointers), and on return argsort, hashes,
    COO indices, the offsets and the batch offset die."""
    dense = (torch.arange(64 * 128).view(64, 128) % 9 == 0).float() * torch.arange(64 * 128).view(64, 128)
    with simulated_cuda(gpu="H200"):
        c = dense.to_sparse_csc().cuda()
        assert c._nnz() == 910
        keep: list[torch.Tensor] = []
        ev = _trace(lambda: keep.append(c.to_sparse_csr()))
        n = 910 * 8
        assert ev == [("alloc", 8), ("alloc", 8), ("free_completed", 8), ("alloc", 1024), ("alloc", 1032),
                      ("free_completed", 1024), ("alloc", 2 * n), ("alloc", n), ("alloc", n), ("free_completed", n),
                      ("free_completed", n), ("alloc", n), ("alloc", n), ("alloc", n), ("alloc", n),
                      ("free_completed", n), ("free_completed", n), ("alloc", 2 * n), ("alloc", 910 * 4),
                      ("alloc", 520), ("alloc", 520), ("alloc", 512),
                      ("free_completed", 512), ("free_completed", 520), ("free_completed", n),
                      ("free_completed", n), ("free_completed", 2 * n), ("free_completed", 1032),
                      ("free_completed", 8)]
        r = keep[0]
        assert r.layout == torch.sparse_csr and torch.equal(r.cpu().to_dense(), dense)
        d = torch.randn(128, 32, device="cuda", requires_grad=True)
        torch.sparse.mm(dense.to_sparse_csr().cuda(), d).sum().backward()   # the backward's t() is CSC
        assert d.grad is not None and d.grad.shape == (128, 32)


def test_pyg_gcn_with_a_csr_adjacency_trains_to_its_end(capsys: pytest.CaptureFixture[str]) -> None:
    """PyG's ``GCNConv`` on a ``ToSparseTensor`` adjacency (tests/corpus/pyg_gcn.py --sparse): a
    ``torch.sparse_csr`` ``adj_t`` on the GPU, trained three epochs. What stays allocated after each
    epoch: the two sm90 cuBLAS workspaces, the features and labels, the CSR row pointers [2709],
    columns and values (one per distinct edge, int64 and float32), the four parameters, their
    gradients and Adam's two moments, and the loss."""
    pytest.importorskip("torch_geometric")
    import torch_geometric.transforms as T
    from torch_geometric.data import Data

    nodes, features = 2708, 1433
    torch.manual_seed(0)   # the program's graph, built on the CPU
    data = T.ToSparseTensor()(Data(x=torch.randn(nodes, features), edge_index=torch.randint(0, nodes, (2, 10556)),
                                   y=torch.randint(0, 7, (nodes,))))
    nnz = data.adj_t._nnz()
    status = run_script(str(_CORPUS / "pyg_gcn.py"), ["--sparse"], gpu="H200")
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    params = [16 * features * 4, 16 * 4, 7 * 16 * 4, 7 * 4]
    expected = (2 * 32 * 1024 * 1024 + _round(nodes * features * 4) + _round(nodes * 8) + _round(2709 * 8)
                + _round(nnz * 8) + _round(nnz * 4) + 4 * sum(_round(p) for p in params) + 512)
    assert lines[:3] == [f"epoch {e}: torch.sparse_csr cuda:0 allocated {expected}" for e in (1, 2, 3)]
