"""Nested tensors on the simulated GPU: jagged nested tensors into ``scaled_dot_product_attention``,
and ``nn.TransformerEncoder``'s nested-tensor fast path.

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
  logsumexp of ``[4, 8, 0]`` (nothing); its backward in
  `test_jagged_float32_backward_allocates_what_efficient_backward_does`.

The encoder sequence (`ENCODER`) is derived in `test_encoder_nested_path_allocates_what_cuda_does`.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from traced import allocator_events  # noqa: E402
from vram.run.kernels.sdpa_choice import sdpa_args  # noqa: E402
from vram.run.kernels.sdpa_jagged import select_jagged_backend  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

LENGTHS = (37, 120, 64, 5)
OUT16, LSE, OFFS32 = 226 * 8 * 64 * 2, 8 * 226 * 4, 5 * 4


def _jagged(dtype: Any, grad: bool = False, heads: int = 8, dim: int = 64) -> Any:
    return torch.nested.nested_tensor([torch.randn(n, heads, dim) for n in LENGTHS], layout=torch.jagged,
                                      device="cuda", dtype=dtype, requires_grad=grad).transpose(1, 2)


def _events(run: Any) -> list[tuple[str, int]]:
    return allocator_events(run, ("alloc", "free_requested"), short=True)


def _inference_attention_events(dtype: Any) -> list[tuple[str, int]]:
    """The events of SDPA over three jagged q, k, v of `dtype` under no_grad."""
    with simulated_cuda("80GiB"):
        q, k, v = (_jagged(dtype) for _ in range(3))
        with torch.no_grad():
            return _events(lambda: F.scaled_dot_product_attention(q, k, v))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_jagged_flash_forward_allocates_what_mha_varlen_fwd_does() -> None:
    got = _inference_attention_events(torch.float16)
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
    got = _inference_attention_events(torch.float32)
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
def test_jagged_float32_backward_allocates_what_efficient_backward_does() -> None:
    """float32 with grad: memory-efficient (a jagged tensor is not strided-nested, so
    ``check_requires_grad_and_nested`` does not apply). Forward: the output (462,848 B) and the
    logsumexp ``[4, 8, ceil(120 / 32) * 32]`` float = 16,384 B. ``_efficient_attention_backward``:
    ``grad_out.contiguous()`` (462,848 B), dq/dk/dv; float32 does not compute the delta in the kernel:
    ``(grad_out * out)`` (462,848 B), ``.sum(-1)`` ``[1, 226, 8]`` (7,232 B), the transposed
    contiguous delta (7,232 B), the first two freed; the workspace: the sm80 float kernel with
    kMaxK 64 has 64 x 64 tiles and accumulates grad_q only: 120 keys give 2 key splits, grad_q
    ``ceil(120 / 64) x ceil(64 / 64) x (4 + 64 x 64)`` = 8,200 floats per (batch, head), times 4
    sequences x 8 heads x 4 B = 1,049,600 B; then the delta, the workspace and the copy die."""
    with simulated_cuda("80GiB"):
        leaves = [_jagged(torch.float32, grad=True) for _ in range(3)]
        loss = F.scaled_dot_product_attention(*leaves).values().sum()
        got = _events(loss.backward)
    out32 = 226 * 8 * 64 * 4
    assert got[:14] == [("a", 4), ("a", out32), ("a", out32), ("a", out32), ("a", out32), ("a", out32),
                        ("a", 7232), ("a", 7232), ("f", 7232), ("f", out32), ("a", 1049600), ("f", 7232),
                        ("f", 1049600), ("f", out32)]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype, dim, grad, message", [
    (torch.float16, 12, False, "takes the math path"),
    (torch.float16, 12, True, "takes the math path"),
])
def test_unmodelled_jagged_paths_stop_with_one_line(dtype: Any, dim: int, grad: bool, message: str) -> None:
    with simulated_cuda("80GiB"):
        q = _jagged(dtype, grad=grad, dim=dim)
        with pytest.raises(NotImplementedError, match=rf"^vram run: .*{message}"):
            F.scaled_dot_product_attention(q, q, q)


# -- nn.TransformerEncoder's nested-tensor fast path ----------------------------------------------------
def _encoder_events(dtype: Any, lengths: tuple[int, ...], layers: int = 1) -> list[tuple[str, int]]:
    with simulated_cuda("80GiB"):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        enc = torch.nn.TransformerEncoder(layer, layers).cuda().to(dtype).eval()
        x = torch.randn(len(lengths), 16, 64, device="cuda", dtype=dtype)
        pad = torch.arange(16, device="cuda")[None, :] >= torch.tensor(lengths, device="cuda")[:, None]
        with torch.inference_mode():
            enc(x, src_key_padding_mask=pad)  # the cuBLAS / cuBLASLt workspaces, once
            out = _events(lambda: enc(x, src_key_padding_mask=pad))
    return out


def _mask_sizes(n: int, length: int) -> list[tuple[str, int]]:
    """``zeros({N, 1})``, ``cat({mask, pad}, 1)`` (bool), ``.to(kInt)``, ``argmin(1)`` (int64), the
    temporaries freed last made first, then ``cumsum(1)``: its int64 output and the int64 copy
    of the bool mask it scans (freed)."""
    return [("a", n), ("a", n * (length + 1)), ("a", 4 * n * (length + 1)), ("a", 8 * n),
            ("f", 4 * n * (length + 1)), ("f", n * (length + 1)), ("a", 8 * n * length), ("a", 8 * n * length),
            ("f", 8 * n * length)]


def test_encoder_nested_path_allocates_what_cuda_does() -> None:
    """Three sequences of 5, 16 and 9 tokens padded to 16, d_model 64, 4 heads of 16, ffn 128,
    float32, one layer (30 tokens, so a [30, 64] float buffer is 7,680 B):

    * ``TransformerEncoder.forward``: ``_canonical_mask`` makes the bool mask a float one (192 B);
      each mask function gets ``mask.logical_not()`` (48 B), freed when it returns;
    * ``_nested_tensor_from_mask_left_aligned``: `_mask_sizes`, then ``cuda_equal``: ``eq`` (3 B),
      ``all`` (1 B), freed; the locals ``nums``, ``tmp_pad``, ``sizes`` die;
    * ``_nested_tensor_from_mask``: `_mask_sizes`, ``full_like(sizes, D)`` (24 B), ``cat(.., 1)``
      (48 B) copied to the host; the cumsum and the cat die; ``nested_from_padded_cuda``: the
      buffer, the int32 metadata (3 x 3 + 4 ints = 52 B) and, the copy being non-blocking, its
      int64 staging copy on the GPU (104 B, freed), then the metadata; ``d``, ``nums``, ``tmp_pad``;
    * the layer: ``nested_linear`` qkv (30 x 192 x 4 = 23,040 B), the int32 cumulative lengths of q
      and k (16 B each), the memory-efficient output (7,680 B; no logsumexp), the lengths die with the
      nested kernel's locals, the output projection, then the attention output and qkv; the rest
      is the dense layer's sequence over 30 rows (layer norm mean/rstd 120 B);
    * the old nested input dies on ``output = mod(output)``; ``to_padded_tensor(0.0, src.size())``:
      the [3, 16, 64] output (12,288 B), the int32 metadata (3 x 3 + 1 ints = 40 B), freed; the last
      nested output; the float mask when ``forward`` returns.
    """
    buf, norm = 7680, [("a", 7680), ("a", 120), ("a", 120), ("f", 120), ("f", 120)]
    expected = [("a", 192), ("a", 48), *_mask_sizes(3, 16), ("a", 3), ("a", 1), ("f", 1), ("f", 3), ("f", 24),
                ("f", 3), ("f", 384), ("f", 48),
                ("a", 48), *_mask_sizes(3, 16), ("a", 24), ("a", 48), ("f", 384), ("f", 48),
                ("a", buf), ("a", 52), ("a", 104), ("f", 104), ("f", 52), ("f", 24), ("f", 24), ("f", 3), ("f", 48),
                ("a", 23040), ("a", 16), ("a", 16), ("a", buf), ("f", 16), ("f", 16), ("a", buf), ("f", buf),
                ("f", 23040), *norm, ("f", buf), ("a", 15360), ("a", buf), ("f", 15360), *norm, ("f", buf),
                ("f", buf), ("f", buf),
                ("a", 12288), ("a", 40), ("f", 40), ("f", buf), ("f", 192),
                ("f", 12288)]  # the output, dropped by the caller
    assert _encoder_events(torch.float32, (5, 16, 9)) == expected


def test_encoder_nested_path_in_half_takes_varlen_flash() -> None:
    # float16: the nested flash kernel; mha_varlen_fwd's out (3,840 B), logsumexp [4, 30] float
    # (480 B), rng_state and _unused; scaled_dot_product_attention's tuple dies in order:
    # logsumexp, the cumulative lengths, rng_state, _unused
    got = _encoder_events(torch.float16, (5, 16, 9))
    i = got.index(("a", 11520))  # qkv: 30 x 192 x 2
    assert got[i:i + 14] == [("a", 11520), ("a", 16), ("a", 16), ("a", 3840), ("a", 480), ("a", 16), ("a", 8),
                             ("f", 480), ("f", 16), ("f", 16), ("f", 16), ("f", 8), ("a", 3840), ("f", 3840)]


def test_encoder_nested_path_is_taken_and_dense_path_still_runs() -> None:
    nested = _encoder_events(torch.float32, (5, 16, 9), layers=2)
    assert ("a", 23040) in nested and ("a", 3 * 16 * 192 * 4) not in nested  # packed, not padded, qkv


def test_encoder_nested_path_with_a_one_token_sequence_pads_again() -> None:
    """Lengths 5, 1, 9 (15 tokens): ``check_for_seq_len_1_nested_tensor`` sends the layer to the
    general branch: ``gemm_nt`` on the buffer (15 x 192 x 4 = 11,520 B), the q/k/v block padded to
    16 (the longest, 9, rounded up to 8: 3 x 3 x 4 x 16 x 16 x 4 = 36,864 B) and its int32 offsets
    and sizes (7 ints = 28 B, freed), the projection dies, ``bmm_nt`` (12 x 16 x 16 x 4 = 12,288 B),
    the ``[3, 16]`` bool mask (48 B), the persistent softmax's output, the mask and the scores die;
    ``bmm_nn`` writes q's storage, the probabilities die; ``nested_from_padded`` (0213): the
    buffer (3,840 B), the int32 metadata (6 sizes + 4 + 4 offsets = 56 B) and its int64 staging
    (112 B); ``addmm`` (3,840 B); ``nested_a``, then the q/k/v block."""
    got = _encoder_events(torch.float32, (5, 1, 9))
    i = got.index(("a", 11520))
    assert got[i:i + 21] == [("a", 11520), ("a", 36864), ("a", 28), ("f", 28), ("f", 11520), ("a", 12288),
                             ("a", 48), ("a", 12288), ("f", 48), ("f", 12288), ("f", 12288), ("a", 3840),
                             ("a", 56), ("a", 112), ("f", 112), ("f", 56), ("a", 3840), ("f", 3840), ("f", 36864),
                             ("a", 3840), ("a", 60)]  # then the first layer norm's output and mean


def test_a_batch_of_one_runs_and_names_the_scans_cub_storage() -> None:
    """One sequence: ``mask.cumsum(1)`` scans a single row, which ``scan_dim`` hands to cub's device
    scan (``numel == size(dim)``); its temporary storage is named, and the nested path begins as
    for three sequences (`test_encoder_nested_path_allocates_what_cuda_does`) with one: the float
    mask (64 B), ``logical_not`` (16 B), then `_mask_sizes(1, 16)`."""
    from vram.run.kernels.sorting import cub_note

    with simulated_cuda("80GiB"):
        torch.manual_seed(0)
        enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 1)
        enc = enc.cuda().eval()
        x = torch.randn(1, 16, 64, device="cuda")
        pad = torch.arange(16, device="cuda")[None, :] >= torch.tensor([7], device="cuda")[:, None]
        with torch.inference_mode():
            enc(x, src_key_padding_mask=pad)
            got = _events(lambda: enc(x, src_key_padding_mask=pad))
        sim = active_sim()
        assert sim is not None and sim.uncharged.get(cub_note("cumsum"), 0) >= 1
    assert got[:2 + len(_mask_sizes(1, 16))] == [("a", 64), ("a", 16), *_mask_sizes(1, 16)]


@pytest.mark.parametrize("dtype, lengths, message", [
    (torch.bfloat16, (5, 16, 9), "bfloat16 input"),
])
def test_unmodelled_encoder_nested_cases_stop_with_one_line(dtype: Any, lengths: tuple[int, ...],
                                                            message: str) -> None:
    with pytest.raises(NotImplementedError, match=rf"^vram run: nn.TransformerEncoder's nested-tensor fast path: "
                                                  rf".*{message}"):
        _encoder_events(dtype, lengths)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_encoder_nested_path_output_has_the_cpu_kernels_values() -> None:
    # the composites never write their buffers: the values come from PyTorch's CPU nested kernels
    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True), 2).eval()
    x = torch.randn(3, 16, 64)
    pad = torch.arange(16)[None, :] >= torch.tensor([5, 16, 9])[:, None]
    with torch.inference_mode():
        expected = enc(x, src_key_padding_mask=pad)
    with simulated_cuda("80GiB"), torch.inference_mode():
        got = enc.cuda()(x.cuda(), src_key_padding_mask=pad.cuda()).cpu()
    assert torch.equal(got, expected)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make", [
    lambda: torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], device="cuda"),
    lambda: torch.nested.as_nested_tensor([torch.randn(3, 8, device="cuda"), torch.randn(5, 8, device="cuda")]),
])
def test_strided_nested_tensors_on_the_gpu_stop_with_one_line(make: Any) -> None:
    with simulated_cuda("80GiB"):
        with pytest.raises(NotImplementedError, match=r"^vram run: strided nested tensors on the simulated GPU"):
            make()
        jagged = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged,
                                            device="cuda")
        assert jagged.is_nested and torch.cuda.memory_allocated() == 512 + 512  # values (256 B), offsets


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jagged_attention_values_in_a_real_values_run(dtype: Any) -> None:
    # the variable-length kernels' values, sequence by sequence (float32: memory-efficient, bf16: flash)
    torch.manual_seed(0)
    parts = [torch.randn(n, 2, 8) for n in (3, 5, 4)]
    expected_out, expected_grads = [], []
    for t in parts:
        x = t.to(dtype).requires_grad_()
        y = F.scaled_dot_product_attention(*(x.transpose(0, 1),) * 3, is_causal=True)
        y.float().pow(2).sum().backward()
        expected_out.append(y.detach().transpose(0, 1))
        expected_grads.append(x.grad)
    with simulated_cuda("80GiB", values="real"):
        leaf = torch.nested.nested_tensor(parts, layout=torch.jagged, device="cuda", dtype=dtype, requires_grad=True)
        q = leaf.transpose(1, 2)
        y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        y.transpose(1, 2).values().float().pow(2).sum().backward()
        out, grad = y.transpose(1, 2).values().detach().cpu(), leaf.grad.values().cpu()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, torch.cat(expected_out), **tol)
    torch.testing.assert_close(grad, torch.cat(expected_grads), **tol)
