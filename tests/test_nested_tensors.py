"""Nested tensors on the simulated GPU: jagged nested tensors into ``scaled_dot_product_attention``.

Every expected sequence is read off PyTorch's source (paths under ``aten/src/ATen/native/transformers/``
and ``torch/nested/_internal/sdpa.py``) for four sequences of lengths 37, 120, 64 and 5 (226 tokens),
8 heads of 64, on the simulated H100:

* ``jagged_scaled_dot_product_attention`` picks flash for float16/bfloat16 (``can_use_flash_attention``'s
  general constraints; a jagged tensor is neither strided-nested nor dense) and memory-efficient
  for float32; ``_cumulative_and_max_seq_len_nnz`` copies q's and k's int64 offsets to int32 on the
  device (5 x 4 = 20 B each); the lengths come from the constructor's cache.
* flash (``mha_varlen_fwd``): out ``empty_like(q)`` = 226 x 8 x 64 x 2 = 231,424 B, softmax_lse
  ``[8, 226]`` float = 7,232 B, rng_state (16 B) and ``_unused`` (8 B); the locals of the Python
  function die in the order of their first assignment (the int32 offsets, then lse, seed, offset).
* flash backward (``_flash_attention_backward`` + ``mha_varlen_bwd``): ``grad_out.contiguous()`` (the
  expanded gradient of ``sum``: 231,424 B), dq/dk/dv, softmax_d ``[8, 226 + 128 x 4]`` float =
  23,616 B, dq_accum ``[226 + 512, 8, 64]`` float = 1,511,424 B, freed in reverse.
* memory-efficient forward without grad: the output ``[1, 226, 8, 64]`` float = 462,848 B and a
  logsumexp of ``[4, 8, 0]`` (nothing).
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from vram.run.kernels.sdpa_choice import sdpa_args  # noqa: E402
from vram.run.kernels.sdpa_jagged import select_jagged_backend  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

LENGTHS = (37, 120, 64, 5)
OUT16, LSE, OFFS32 = 226 * 8 * 64 * 2, 8 * 226 * 4, 5 * 4


def _jagged(dtype: Any, grad: bool = False, heads: int = 8, dim: int = 64) -> Any:
    return torch.nested.nested_tensor([torch.randn(n, heads, dim) for n in LENGTHS], layout=torch.jagged,
                                      device="cuda", dtype=dtype, requires_grad=grad).transpose(1, 2)


def _events(run: Any) -> list[tuple[str, int]]:
    torch.cuda.memory._record_memory_history()
    run()
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    return [(e["action"][0], e["size"]) for e in events if e["action"] in ("alloc", "free_requested")]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_jagged_flash_forward_allocates_what_mha_varlen_fwd_does() -> None:
    with simulated_cuda("80GiB"):
        q, k, v = (_jagged(torch.float16) for _ in range(3))
        with torch.no_grad():
            got = _events(lambda: F.scaled_dot_product_attention(q, k, v))
    assert got == [("a", OFFS32), ("a", OFFS32), ("a", OUT16), ("a", LSE), ("a", 16), ("a", 8),
                   ("f", OFFS32), ("f", OFFS32), ("f", LSE), ("f", 16), ("f", 8),
                   ("f", OUT16)]  # the unused output


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_jagged_flash_backward_allocates_what_mha_varlen_bwd_does() -> None:
    with simulated_cuda("80GiB"):
        leaves = [_jagged(torch.bfloat16, grad=True) for _ in range(3)]
        out = F.scaled_dot_product_attention(*leaves)
        loss = out.values().sum()
        got = _events(loss.backward)
    softmax_d, dq_accum = 8 * (226 + 128 * 4) * 4, (226 + 128 * 4) * 8 * 64 * 4
    kernel = [("a", 2), ("a", OUT16), ("a", OUT16), ("a", OUT16), ("a", OUT16), ("a", softmax_d),
              ("a", dq_accum), ("f", dq_accum), ("f", softmax_d), ("f", OUT16)]
    assert got[:len(kernel)] == kernel  # the initial gradient, grad_out's copy, dq/dk/dv, scratch


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_jagged_float32_takes_the_memory_efficient_kernel() -> None:
    with simulated_cuda("80GiB"):
        q, k, v = (_jagged(torch.float32) for _ in range(3))
        with torch.no_grad():
            got = _events(lambda: F.scaled_dot_product_attention(q, k, v))
    assert got == [("a", OFFS32), ("a", OFFS32), ("a", 226 * 8 * 64 * 4), ("f", OFFS32), ("f", OFFS32),
                   ("f", 226 * 8 * 64 * 4)]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lengths_read_from_the_offsets_when_not_cached() -> None:
    # nested_tensor_from_jagged caches no lengths: _get_max_seqlen reads offsets.diff().max()
    with simulated_cuda("80GiB"):
        offsets = torch.tensor([0, 37, 157, 221, 226], device="cuda")
        q, k, v = (torch.nested.nested_tensor_from_jagged(torch.randn(226, 8, 64, device="cuda", dtype=torch.float16),
                                                          offsets).transpose(1, 2) for _ in range(3))
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert out.transpose(1, 2).values().shape == (226, 8, 64)


@pytest.mark.parametrize("dtype, grad, dim, causal, expected", [
    (torch.float16, False, 64, False, "flash"),
    (torch.bfloat16, True, 64, True, "flash"),  # causal with ragged q/k lengths: nested inputs skip that check
    (torch.float32, False, 64, False, "efficient"),
    (torch.float32, True, 64, False, "efficient"),  # the strided-nested training check does not apply
    (torch.float16, False, 12, False, "math"),  # 12: no multiple of 8 for flash nor mem-efficient
    (torch.float16, False, 12, True, "cudnn"),  # math refuses is_causal; cuDNN's general constraints pass
])
def test_jagged_backend_choice_follows_torch_nested_sdpa(dtype: Any, grad: bool, dim: int, causal: bool,
                                                         expected: str) -> None:
    q = torch.nested.nested_tensor([torch.randn(n, 2, dim) for n in LENGTHS], layout=torch.jagged, dtype=dtype,
                                   requires_grad=grad).transpose(1, 2)
    k = torch.nested.nested_tensor([torch.randn(n + 1, 2, dim) for n in LENGTHS], layout=torch.jagged, dtype=dtype,
                                   requires_grad=grad).transpose(1, 2)
    p = sdpa_args((q, k, k), {"is_causal": causal})
    assert select_jagged_backend(p, 9, 0) == expected


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype, dim, grad, message", [
    (torch.float16, 12, False, "takes the math path"),
    (torch.float32, 64, True, "backward of memory-efficient attention on jagged"),
])
def test_unmodelled_jagged_paths_stop_with_one_line(dtype: Any, dim: int, grad: bool, message: str) -> None:
    with simulated_cuda("80GiB"):
        q = _jagged(dtype, grad=grad, dim=dim)
        with pytest.raises(NotImplementedError, match=rf"^vram run: .*{message}"):
            F.scaled_dot_product_attention(q, q, q)
