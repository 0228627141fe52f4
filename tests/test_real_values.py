"""The real-values mode of ``vram run``.

Expectations come from the same code run by plain CPU torch: in this mode every simulated op
also runs on CPU copies, with the CPU kernels a CPU run uses, so a training run's losses are
expected *bit for bit* (the simulated GPU takes the CUDA paths — foreach AdamW, the
memory-efficient attention kernel — whose values are computed here by the same elementwise CPU
kernels and by the CPU flash-attention kernel that a CPU run of SDPA picks), provided the CPU run
uses as many intra-op threads as the value ops (`storages.VALUE_THREADS`: a parallel reduction
splits its sum differently per thread count, which changes the last bits). Tensors are made
larger than the default mode's value limit, so without this mode the same reads are
placeholders (checked too). The allocator must see exactly what it sees in the default mode.
"""
from __future__ import annotations

import copy
import math
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
tree_leaves = pytest.importorskip("torch.utils._pytree").tree_leaves
nn = torch.nn
F = torch.nn.functional

from vram.run.memory import storages  # noqa: E402
from vram.run.runtime import active_sim, run_script, simulated_cuda  # noqa: E402
from vram.run.values import real_values  # noqa: E402
from vram.run.values.known import VALUE_LIMIT  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, 2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A tiny GPT: tied embedding/head, causal SDPA; its MLP weights exceed `VALUE_LIMIT`."""

    def __init__(self, vocab: int = 32, d: int = 160, h: int = 4, n: int = 2, T: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1)) if targets is not None else None
        return logits, loss


def train(device: str, steps: int = 30) -> list[float]:
    """nanoGPT-style: model built on the CPU and moved, AdamW, random batches, loss.item() each step."""
    torch.manual_seed(0)
    model = GPT().to(device)
    assert model.blocks[0].mlp[0].weight.numel() > VALUE_LIMIT
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = torch.arange(256) % 7
    losses = []
    for _ in range(steps):
        ix = torch.randint(0, 256 - 17, (8,), generator=g)
        x = torch.stack([data[i:i + 16] for i in ix]).to(device)
        y = torch.stack([data[i + 1:i + 17] for i in ix]).to(device)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def generate(device: str, eos: int = 7, max_new: int = 20) -> tuple[list[int], int]:
    """Teach a model "0 1 2 3 4 5 EOS", then greedy decoding that stops at EOS; and a checkpoint
    counter that depends on the losses (``if loss < best``)."""
    torch.manual_seed(0)
    model = GPT(vocab=8).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    data = torch.arange(64) % 7
    data = torch.where(data == 6, torch.tensor(eos), data)
    best, saves = math.inf, 0
    for _ in range(40):
        _, loss = model(data[:16].unsqueeze(0).to(device), data[1:17].unsqueeze(0).to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < best:
            best, saves = loss.item(), saves + 1
    idx = torch.tensor([[0]], device=device)
    with torch.no_grad():
        for _ in range(max_new):
            logits, _ = model(idx)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            idx = torch.cat([idx, nxt], 1)
            if nxt.item() == eos:
                break
    return idx[0].tolist(), saves


def on_cpu(run, *args):  # noqa: ANN001, ANN201
    """`run` on plain CPU torch with the value ops' thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(storages.VALUE_THREADS or threads)
    try:
        return run(*args)
    finally:
        torch.set_num_threads(threads)


def test_training_losses_equal_a_cpu_run_bit_for_bit_and_decrease() -> None:
    cpu = on_cpu(train, "cpu")
    threads = torch.get_num_threads()
    with simulated_cuda(values="real"):
        sim = train("cuda")
        assert active_sim().report.render() == ""  # no placeholder was used
        assert torch.get_num_threads() == threads  # the value ops' one thread is theirs alone
    assert sim == cpu
    assert sim[-1] < 0.7 * sim[0]


def test_generate_stops_at_eos_and_checkpoints_follow_the_losses() -> None:
    tokens, saves = on_cpu(generate, "cpu")
    assert tokens[-1] == 7 and len(tokens) < 21 and 1 < saves < 40  # the data stops it, not max_new
    with simulated_cuda(values="real"):
        assert generate("cuda") == (tokens, saves)
        assert active_sim().report.sites == {}
    with simulated_cuda():  # the default mode: placeholders, so no EOS is seen
        assert generate("cuda")[0] != tokens
        assert active_sim().report.sites


def _memory_of(values: str, backend: str) -> dict[str, int]:
    with simulated_cuda("24GiB", values=values, backend=backend):
        train("cuda", steps=3)
        return dict(torch.cuda.memory_stats())


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_allocator_sees_the_same_as_the_default_mode(backend: str) -> None:
    default, real = _memory_of("known", backend), _memory_of("real", backend)
    assert real["allocated_bytes.all.peak"] > 0 and real["num_alloc_retries"] == 0
    assert real == default


def test_bf16_autocast_computes_in_the_gpu_dtype() -> None:
    a, b = torch.randn(64, 300), torch.randn(300, 256)
    with simulated_cuda(values="real"):
        with torch.autocast("cuda", torch.bfloat16):
            y = a.cuda() @ b.cuda()
        assert y.dtype == torch.bfloat16
        assert torch.equal(y.cpu(), a.bfloat16() @ b.bfloat16())


def test_flash_attention_dropout_mask_is_the_same_in_backward() -> None:
    """Query zeros and value the identity make the output show the mask the forward drew (kept
    weights are 2/(i+1) on row i, dropped ones 0); the gradients must be those of the formula
    with that mask."""
    L = 64
    q, k = torch.zeros(1, 2, L, L), torch.randn(1, 2, L, L)
    v = torch.eye(L).expand(1, 2, L, L).contiguous()
    with simulated_cuda(values="real"):
        qs, ks, vs = (t.cuda().bfloat16().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=0.5, is_causal=True)  # flash, with dropout
        out.float().sum().backward()
        got, seen = [t.grad.cpu() for t in (qs, ks, vs)], out.detach().cpu().float()
        assert active_sim().report.sites == {}
    keep = (seen > 0).float()
    rows = torch.arange(1, L + 1).view(L, 1)
    assert torch.allclose(seen, keep * 2 / rows, rtol=1e-2) and 0.3 < keep.sum() / (L * (L + 1)) < 0.7
    qc, kc, vc = (t.bfloat16().float().requires_grad_() for t in (q, k, v))
    ref, _ = real_values._math_attention(qc, kc, vc, None, True, None, keep, 0.5)
    ref.sum().backward()
    for g, r in zip(got, (qc.grad, kc.grad, vc.grad)):
        assert torch.allclose(g.float(), r, rtol=2e-2, atol=2e-2)


def test_grouped_query_attention_values_and_gradients() -> None:
    q, k, v = torch.randn(2, 8, 32, 64), torch.randn(2, 2, 32, 64), torch.randn(2, 2, 32, 64)
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
    ref.sum().backward()
    with simulated_cuda(values="real"):
        qs, ks, vs = (t.cuda().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        out.sum().backward()
        assert torch.allclose(out.cpu(), ref, atol=1e-5)
        for s, r in zip((qs, ks, vs), (qc, kc, vc)):
            assert torch.allclose(s.grad.cpu(), r.grad, atol=1e-4)


SCRIPT = """\
import torch
x = torch.randn(300, 300, device="cuda")
print("trace", torch.trace(x @ x.T).item() > 0)
"""


def test_host_memory_that_cannot_hold_the_values_is_refused_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    path = tmp_path / "big.py"
    path.write_text(SCRIPT)
    assert run_script(str(path), [], values="real") == 0
    assert capsys.readouterr().out == "trace True\n"
    monkeypatch.setattr(storages, "host_available", lambda: storages.HOST_RESERVE)
    monkeypatch.setattr(storages, "CHECK_EVERY", 0)
    assert run_script(str(path), [], values="real") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--values real" in err[0] and "host memory" in err[0]


def test_an_op_with_no_cpu_kernel_is_reported_with_its_reason() -> None:
    lib = torch.library.Library("vramrv", "DEF")  # noqa: TOR901
    lib.define("cuda_only(Tensor x) -> Tensor")
    lib.impl("cuda_only", lambda x: torch.empty_like(x), "Meta")
    with simulated_cuda(values="real"):
        y = torch.ops.vramrv.cuda_only(torch.ones(4, device="cuda"))
        assert y.sum().item() == 0.0  # a placeholder, reported with why
        (site,) = active_sim().report.sites.values()
        assert "failed on the CPU" in site.assumed and "vramrv.cuda_only" in site.assumed


def test_bad_values_argument_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown vram run values 'exact'"):
        with simulated_cuda(values="exact"):
            pass


def test_cli_flag(tmp_path: Path, capsys) -> None:
    from vram.cli import main

    path = tmp_path / "branch.py"
    path.write_text(textwrap.dedent("""\
        import torch
        torch.manual_seed(0)
        w = torch.randn(512, 512).cuda()
        print("positive" if (w @ w).trace().item() > 0 else "negative")
        """))
    torch.manual_seed(0)
    w = torch.randn(512, 512)
    expected = "positive" if (w @ w).trace().item() > 0 else "negative"
    assert main(["run", "--values", "real", str(path)]) == 0
    out = capsys.readouterr()
    assert out.out == expected + "\n" and "placeholder" not in out.err


def test_grad_scaler_skips_the_step_its_inf_gradients_call_for() -> None:
    """``GradScaler`` reads ``found_inf``: a scale of 2**40 overflows float16 gradients, so the
    step is skipped and the scale backs off by half (torch/amp/grad_scaler.py), as on a GPU."""
    torch.manual_seed(0)
    model, x = nn.Linear(64, 64), torch.randn(8, 64)
    with simulated_cuda(values="real"):
        m = model.cuda()
        before = m.weight.detach().cpu()
        opt = torch.optim.AdamW(m.parameters())
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)
        with torch.autocast("cuda", torch.float16):
            loss = m(x.cuda()).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0**39 and torch.equal(m.weight.detach().cpu(), before)
        assert not opt.state  # no step: no optimizer state allocated


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_transformer_inference_fast_paths_compute_the_fused_ops_values(backend: str) -> None:
    """In ``eval()`` without grad, ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` call the
    fused ops (`vram.run.kernels.fastpath`), whose allocation models leave their scratch unwritten: the
    outputs must hold what the fused CPU kernels compute (plain CPU torch takes the same fast path)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 1024, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    mha = nn.MultiheadAttention(128, 4, batch_first=True).eval()
    assert layer.linear1.weight.numel() > VALUE_LIMIT
    x, mask = torch.randn(3, 40, 128), nn.Transformer.generate_square_subsequent_mask(40)
    with torch.no_grad():
        ref = on_cpu(lambda: (enc(x, mask=mask), mha(x, x, x), mha(x, x, x, need_weights=False)[0]))
    with simulated_cuda(values="real", backend=backend), torch.no_grad():
        e, m, xs = copy.deepcopy(enc).cuda(), copy.deepcopy(mha).cuda(), x.cuda()
        got = (e(xs, mask=mask.cuda()), m(xs, xs, xs), m(xs, xs, xs, need_weights=False)[0])
        for g, r in zip(tree_leaves(got), tree_leaves(ref)):
            assert torch.equal(g.cpu(), r)
        assert active_sim().report.sites == {}


SAVED = """\
import io, torch
torch.manual_seed(0)
x, m = torch.randn(4, 300), torch.nn.Linear(300, 300)
expected = m(x).sum().item()
buf = io.BytesIO()
torch.save(m.cuda(), buf)
buf.seek(0)
print(torch.load(buf, weights_only=False)(x.cuda()).sum().item() == expected)
"""


def test_a_loaded_checkpoint_holds_its_exact_values(tmp_path: Path, capsys) -> None:
    """``torch.load`` onto the GPU (word_language_model reloads its best model to test it): the
    loaded storages hold the checkpoint's bytes, not values computed from placeholders."""
    path = tmp_path / "load.py"
    path.write_text(SAVED)
    assert run_script(str(path), [], values="real") == 0
    out = capsys.readouterr()
    assert out.out == "True\n" and "placeholder" not in out.err


def test_histc_counts_integers_as_cuda_does() -> None:
    """MoE layers (transformers' Mixtral/Qwen-MoE ``grouped_mm`` experts) count tokens per expert with
    ``torch.histc`` on int32 ids: CUDA's kernel takes integer types, the CPU's only floating ones.
    The counts must be those of the same rule on the floats (SummaryOps.cu: integer bins)."""
    ids = torch.randint(0, 8, (4096,), dtype=torch.int32)
    with simulated_cuda(values="real"):
        x = ids.cuda()
        got = [torch.histc(x, bins=8, min=0, max=7), torch.histc(x, bins=5, min=2, max=6), torch.histc(x, bins=3)]
        assert all(g.dtype == torch.int32 for g in got)
        got = [g.cpu() for g in got]
        assert active_sim().report.sites == {}
    f = ids.float()
    expected = [torch.histc(f, bins=8, min=0, max=7), torch.histc(f, bins=5, min=2, max=6), torch.histc(f, bins=3)]
    for g, e in zip(got, expected):
        assert torch.equal(g, e.int())
