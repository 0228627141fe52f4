"""``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` in inference take PyTorch's fused path
(``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``) under ``vram run`` as
on a GPU, and allocate what the CUDA code allocates. Every expected sequence below is
read off the CUDA source, step by step (B=2, T=16, D=64, 4 heads of 16, float32, H100):

* ``native_multi_head_attention_cuda`` (native/transformers/cuda/attention.cu): with q is k is v, no
  weights wanted and no mask, ``select_sdp_backend`` picks mem-efficient for float32, so
  ``linear`` (qkv: [32, 192] = 24576 B), SDPA (output [B, T, NH, DH] = 8192 B, no logsumexp under
  no_grad, no accumulator for float32 with DH <= 64), a reshape that is a view, ``linear`` (proj,
  8192 B), then the C++ locals die: SDPA output, qkv.
* otherwise ``qkv_projection`` (``matmul(x, w.t())``: 24576 B), ``transform_bias_rescale_qkv_cuda``
  (``empty({3, B, NH, T, DH})``: 24576 B), ``qkv = Tensor()`` frees the projection, ``bmm_nt``
  (scores [8, 16, 16] = 8192 B), ``masked_softmax`` (in place without a mask; a non-bool mask is
  copied to bool, ``masked_softmax_cuda`` makes ``empty_like(scores)`` and its persistent kernel
  writes it; the copy dies on return, then the old scores), ``bmm_nn`` writes into q's storage,
  the scores die unless weights are wanted, ``transform0213_gemm_nt_bias`` (a contiguous copy
  8192 B, ``linear`` 8192 B, the copy dies), ``qkt.sum(1)`` for averaged weights (2048 B), and
  the q/k/v block dies when the function returns.
* ``transformer_encoder_layer_forward`` (native/transformers/transformer.cpp): attention as above,
  ``add_``, ``layer_norm`` (output 8192 B, mean and rstd 128 B each, freed; the old x dies),
  ``_addmm_activation`` ([32, 128] = 16384 B), ``addmm`` (8192 B; the first dies), ``add_``,
  ``layer_norm``, the old x, then ``pre_ffn_res`` when the function returns.
* ``MultiheadAttention.forward`` itself (Python) turns a bool ``key_padding_mask`` into a float
  one (128 B) and a [T, T] bool ``attn_mask`` into a float one (1024 B) first.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from vram.run.kernels import fastpath  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

QKV, OUT, MEAN = 24576, 8192, 128
MHA = [("a", QKV), ("a", OUT), ("a", OUT), ("f", OUT), ("f", QKV)]  # the SDPA branch
NORM = [("a", OUT), ("a", MEAN), ("a", MEAN), ("f", MEAN), ("f", MEAN), ("f", OUT)]


def _mha() -> Any:
    return nn.MultiheadAttention(64, 4, batch_first=True)


def _layer() -> Any:
    return nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)


def _causal() -> Any:
    return torch.ones(16, 16, dtype=torch.bool, device="cuda").triu(1)


CASES = {
    "mha_sdpa": (_mha, lambda m, x, pad: m(x, x, x, need_weights=False)[0], MHA),
    "mha_padding_mask": (_mha, lambda m, x, pad: m(x, x, x, key_padding_mask=pad, need_weights=False)[0], [
        ("a", 128), ("a", QKV), ("a", QKV), ("f", QKV), ("a", OUT), ("a", 32), ("a", OUT), ("f", 32), ("f", OUT),
        ("f", OUT), ("a", OUT), ("a", OUT), ("f", OUT), ("f", QKV), ("f", 128)]),
    "mha_weights": (_mha, lambda m, x, pad: m(x, x, x)[1], [
        ("a", QKV), ("a", QKV), ("f", QKV), ("a", OUT), ("a", OUT), ("a", OUT), ("f", OUT), ("a", 2048),
        ("f", OUT), ("f", QKV), ("f", OUT)]),  # the last: the unused output, dropped by the caller
    "mha_attn_mask": (_mha, lambda m, x, pad: m(x, x, x, attn_mask=_causal(), need_weights=False)[0], [
        ("a", 256), ("a", 256), ("f", 256), ("a", 1024),  # ones, triu, the float mask
        # the [T, T] mask expanded to [B, NH, T, T] (mask type 2) is not dense: its bool copy is
        ("a", QKV), ("a", QKV), ("f", QKV), ("a", OUT), ("a", 2048), ("a", OUT), ("f", 2048), ("f", OUT),
        ("f", OUT), ("a", OUT), ("a", OUT), ("f", OUT), ("f", QKV), ("f", 1024), ("f", 256)]),
    "encoder_layer": (_layer, lambda m, x, pad: m(x), MHA + NORM + [
        ("a", 16384), ("a", OUT), ("f", 16384)] + NORM + [("f", OUT)]),
}


def _requests(make: Any, call: Any, backend: str) -> list[tuple[str, int]]:
    with simulated_cuda("80GiB", backend=backend):
        torch.manual_seed(0)
        m = make().cuda().eval()
        x = torch.randn(2, 16, 64, device="cuda")
        pad = torch.zeros(2, 16, dtype=torch.bool, device="cuda")
        with torch.no_grad():
            call(m, x, pad)  # the cuBLAS / cuBLASLt workspaces, once per stream
            torch.cuda.memory._record_memory_history()
            out = call(m, x, pad)
            events = torch.cuda.memory._snapshot()["device_traces"][0]
            del out
    return [(e["action"][0], e["size"]) for e in events if e["action"] in ("alloc", "free_requested")]


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inference_allocates_what_the_fused_cuda_path_does(case: str, backend: str) -> None:
    make, call, expected = CASES[case]
    assert _requests(make, call, backend) == expected


def _fused_calls(monkeypatch: pytest.MonkeyPatch, run: Any) -> list[str]:
    calls: list[str] = []
    for func, impl in list(fastpath.FUSED.items()):
        monkeypatch.setitem(fastpath.FUSED, func, lambda a, k, M, m, impl=impl, n=func.__name__: (
            calls.append(n), impl(a, k, M, m))[1])
    with simulated_cuda("80GiB"):
        m = _layer().cuda()
        x = torch.randn(2, 16, 64, device="cuda")
        run(m, x)
    return calls


@pytest.mark.parametrize("setting, taken", [
    ({"eval": True, "no_grad": True}, True),
    ({"no_grad": True}, False),  # training mode
    ({"eval": True}, False),  # grad enabled and the parameters require grad
    ({"eval": True, "frozen": True}, True),
    ({"eval": True, "no_grad": True, "autocast": True}, False),
    # a hook on the layer blocks its path, not the one of its self_attn (MultiheadAttention checks no hooks)
    ({"eval": True, "no_grad": True, "hook": True}, "_native_multi_head_attention"),
])
def test_the_fast_path_is_taken_when_a_gpu_takes_it(monkeypatch: pytest.MonkeyPatch, setting: dict[str, bool],
                                                   taken: bool | str) -> None:
    """The checks in TransformerEncoderLayer.forward decide, as on a GPU; only vram's mode is unseen."""
    def run(m: Any, x: Any) -> None:
        m.train(not setting.get("eval"))
        m.requires_grad_(not setting.get("frozen"))
        if setting.get("hook"):
            m.register_forward_hook(lambda *a: None)
        with torch.set_grad_enabled(not setting.get("no_grad")), torch.autocast("cuda",
                                                                                enabled=bool(setting.get("autocast"))):
            m(x)
    expected = [taken] if isinstance(taken, str) else ["_transformer_encoder_layer_fwd"] if taken else []
    assert _fused_calls(monkeypatch, run) == expected


def test_another_torch_function_mode_still_blocks_it(monkeypatch: pytest.MonkeyPatch) -> None:
    class Passing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    def run(m: Any, x: Any) -> None:
        with torch.no_grad(), Passing():
            m.eval()(x)
    assert _fused_calls(monkeypatch, run) == []


def test_nested_tensor_path_and_dense_path_both_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # what the nested path allocates: tests/test_nested_tensors.py
    calls: list[str] = []
    for func, impl in list(fastpath.FUSED.items()):
        monkeypatch.setitem(fastpath.FUSED, func, lambda a, k, M, m, impl=impl, n=func.__name__: (
            calls.append(n), impl(a, k, M, m))[1])
    with simulated_cuda("80GiB"):
        enc = nn.TransformerEncoder(_layer(), 2).cuda().eval()
        x = torch.randn(2, 16, 64, device="cuda")
        pad = torch.zeros(2, 16, dtype=torch.bool, device="cuda")
        pad[1, 10:] = True
        with torch.no_grad():
            assert enc(x, src_key_padding_mask=pad).shape == (2, 16, 64)
        assert calls == ["_nested_tensor_from_mask_left_aligned", "_nested_tensor_from_mask",
                         "_transformer_encoder_layer_fwd", "_transformer_encoder_layer_fwd", "nested_to_padded_tensor"]
        dense = nn.TransformerEncoder(_layer(), 2, enable_nested_tensor=False).cuda().eval()
        with torch.no_grad():
            assert dense(x, src_key_padding_mask=pad).shape == (2, 16, 64)


def test_forward_methods_are_restored_after_the_run() -> None:
    before = {c: c.__dict__["forward"] for c in (nn.MultiheadAttention, nn.TransformerEncoderLayer)}
    with simulated_cuda("80GiB"):
        assert nn.MultiheadAttention.__dict__["forward"] is not before[nn.MultiheadAttention]
    assert {c: c.__dict__["forward"] for c in before} == before
