"""vram's simulated allocator against PyTorch's own tensor-level tracker, ``MemTracker``.

``torch.distributed._tools.mem_tracker.MemTracker`` (shipped with torch 2.13) is a
``TorchDispatchMode`` that adds up the storage of every tensor an op creates and subtracts it when
the storage dies, per device, rounding CUDA storages up to the allocator's 512-byte minimum. It
runs here on **real CPU tensors** (the CPU build cannot make fake CUDA tensors: ``FakeTensorMode``
fails with "PyTorch is not linked with support for cuda devices" as soon as a CUDA tensor is
initialised), with its rounding applied to CPU storages too, so that both sides count
``round512(nbytes)`` per storage.

The same training step (forward, backward, Adam step; for a toy GPT and CNN, and for the
corpus's Hugging Face GPT-2 and grouped-query Llama) then runs twice — for real on the CPU under
MemTracker, and under `vram.run.runtime.simulated_cuda` — with a probe mode recording, after every
aten op, MemTracker's running total (CPU) and ``torch.cuda.memory_allocated()`` plus the live
blocks (vram). The test asserts, op by op and for the peak, with nothing left to a tolerance::

    vram_allocated(op) == memtracker(op) - host(op) + workspaces(op) + tails(op)

* ``host``: tensors the CPU run creates that a CUDA run keeps in host memory — ``torch.tensor(x)``
  without a device (``aten.lift_fresh``), i.e. Adam's ``state["step"]`` scalars (capturable=False)
  and its ``torch.tensor(1.0)`` step increment. MemTracker counts them; the CUDA allocator never
  sees them.
* ``workspaces``: the cuBLAS workspace each thread allocates at its first cuBLAS call and keeps
  (``getChosenWorkspaceSize()``: 8,519,680 B below sm90, 32 MiB on sm90; CUDA runs backward on the
  autograd engine's device thread, so the first backward matmul allocates a second one) and the
  1 MiB cuBLASLt workspace of the first ``addmm`` that takes the Lt path (1-D bias, beta 1, 2-D
  contiguous result, all dims > 1) — computed here from the CPU run's op log with those rules from
  ``aten/src/ATen/cuda/CublasHandlePool.cpp`` / ``native/cuda/Blas.cpp``, not read from vram.
* ``tails``: ``memory_allocated`` counts *block* sizes, and the allocator does not split a large
  block whose remainder would be ≤ 1 MiB (kSmallSize, spec §8), so a 4.5 MiB request served by a
  5 MiB block counts 5 MiB. Each tail is read off vram's snapshot and checked against that rule.

The op sequences must agree name for name, except scaled-dot-product attention, where CPU runs
``_scaled_dot_product_flash_attention_for_cpu`` (float32) and CUDA picks the memory-efficient
kernel (flash needs fp16/bf16): the outputs that outlive the op — out, logsumexp — have the same
sizes (sequence length a multiple of 32, the efficient kernel's logsumexp padding); the efficient
kernel's philox seed/offset are host tensors without dropout. See docs/estimate-accuracy.md.
"""
from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from torch.distributed._tools import mem_tracker as _mt  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vram.run.runtime import simulated_cuda  # noqa: E402

MiB = 1 << 20
CUBLAS = {(8, 0): 4096 * 1024 * 2 + 16 * 1024 * 8, (9, 0): 4096 * 8 * 1024}  # getChosenWorkspaceSize()
CUBLASLT = 1024 * 1024                                                      # CUBLASLT_WORKSPACE_SIZE
CUBLAS_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot", "_addmm_activation"}
SDPA_CPU_TO_CUDA = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default":
        "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default":
        "aten._scaled_dot_product_efficient_attention_backward.default",
}


def r512(n: int) -> int:
    return -(-n // 512) * 512


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)
    # MemTracker rounds only CUDA storages (to _PYTORCH_MIN_ALLOCATE = 512); round CPU ones too
    monkeypatch.setattr(_mt._WeakRefInfo, "_calculate_mem_consumed",
                        lambda self: r512(self.size * self.element_size))


# -- the models ---------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 1024, ctx: int = 128, d: int = 256, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def gpt_setup(device: str, foreach: bool | None) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = TinyGPT().to(device)
    opt = torch.optim.Adam(model.parameters(), foreach=foreach)
    idx = torch.randint(0, 1024, (8, 128), device=device)
    tgt = torch.randint(0, 1024, (8, 128), device=device)
    return model, opt, idx, tgt


def gpt_step(model: Any, opt: Any, idx: Any, tgt: Any) -> None:
    loss = F.cross_entropy(model(idx).view(-1, 1024), tgt.view(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def cnn_setup(device: str, foreach: bool | None) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = TinyCNN().to(device)
    opt = torch.optim.Adam(model.parameters(), foreach=foreach)
    x = torch.randn(16, 3, 64, 64, device=device)
    y = torch.randint(0, 10, (16,), device=device)
    return model, opt, x, y


def cnn_step(model: Any, opt: Any, x: Any, y: Any) -> None:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


# -- the two probes -----------------------------------------------------------------------------
def _lt_addmm(func: Any, args: Any, kwargs: Any, out: Any) -> bool:
    """``isInputCompliesAddmmCudaLt``: 1-D contiguous bias, beta 1, 2-D contiguous result, dims > 1."""
    if func.overloadpacket.__name__ not in ("addmm", "_addmm_activation") or len(args) < 3:
        return False
    bias, m1, m2 = args[0], args[1], args[2]
    beta = kwargs.get("beta", 1)
    return (beta == 1 and bias.dim() == 1 and bias.is_contiguous() and bias.size(0) == m2.size(1)
            and out.dim() == 2 and out.is_contiguous()
            and min(m1.size(0), m1.size(1), m2.size(0), m2.size(1)) > 1)


class CpuProbe(TorchDispatchMode):
    """After each op: MemTracker's total, the host-resident part, and the cuBLAS workspaces a CUDA
    run would hold by then (computed from the op, its phase and the rules above)."""

    def __init__(self, tracker: MemTracker, cublas: int) -> None:
        super().__init__()
        self.tracker, self.cublas = tracker, cublas
        self.host: dict[int, int] = {}
        self._refs: list[Any] = []
        self.workspaces: set[str] = set()
        self.log: list[tuple[str, int, int]] = []  # (op, memtracker - host, workspace bytes)

    def _host(self, out: Any) -> None:
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            st = t.untyped_storage()
            key = id(st)
            self.host[key] = r512(st.nbytes())
            self._refs.append(weakref.ref(st, lambda _r, key=key: self.host.pop(key, None)))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("lift_fresh", "lift_fresh_copy"):   # torch.tensor(x): host memory on a GPU run
            self._host(out)
        thread = "autograd" if torch._C._current_autograd_node() is not None else "main"
        if name in CUBLAS_OPS and out.is_floating_point():
            self.workspaces.add(f"cublas/{thread}")
            if _lt_addmm(func, args, kwargs, out):
                self.workspaces.add(f"cublaslt/{thread}")
        ws = sum(self.cublas if w.startswith("cublas/") else min(CUBLASLT, self.cublas)
                 for w in self.workspaces)
        total = sum(snap.get("Total", 0) for snap in self.tracker._curr_mem_snap.values())
        self.log.append((str(func), total - sum(self.host.values()), ws))
        return out


class VramProbe(TorchDispatchMode):
    """After each op: memory_allocated() and the tails of the live blocks (block size minus the
    512-rounded request), each checked against the allocator's no-split rule."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, int, int]] = []  # (op, memory_allocated, tails)
        self.peak_seen = 0
        self.scratch: list[int] = []  # bytes a reduction's launch holds on top, freed before it returns

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tails = 0
        for seg in torch.cuda.memory_snapshot():
            for b in seg["blocks"]:
                if b["state"] != "active_allocated":
                    continue
                tail = b["size"] - r512(b["requested_size"])
                if tail:  # spec §8: a large block is split only when more than 1 MiB would remain
                    assert seg["segment_type"] == "large" and 0 < tail <= MiB, (b, seg["segment_type"])
                    tails += tail
        allocated = torch.cuda.memory_allocated()
        self.peak_seen = max(self.peak_seen, allocated)
        self.log.append((str(func), allocated, tails))
        self.scratch.append(_bias_grad_staging(func, args))
        return out


def _bias_grad_staging(func: Any, args: Any) -> int:
    """The staging buffer + semaphores of a Linear bias gradient, ``sum(0)`` of an fp32 [1024, F]
    (F a multiple of 128), on 132 SMs of 2,048 threads (``Reduce.cuh`` setReduceConfig): outputs
    F, output vec 4 -> block 32x4 (128 threads), grid F/128, values/thread 1024/4 = 256 -> ctas =
    max(min(2112/grid, 256/16 = 16), 1) = 16; buffer 4 * F * 16 * block.x 32 * vec 4 = 8,192 * F,
    semaphores 4 * F/128 (one 512-byte block)."""
    x = args[0] if args else None
    if str(func) != "aten.sum.dim_IntList" or not isinstance(x, torch.Tensor) or x.dim() != 2 \
            or x.shape[0] != 1024 or list(args[1]) != [0] or x.shape[1] % 128:
        return 0
    return r512(8192 * x.shape[1]) + 512


def _trace_cpu(setup: Callable[..., Any], step: Callable[..., Any], cublas: int) -> tuple[list[Any], int]:
    model, opt, a, b = setup("cpu", True)  # CUDA's default for Adam is foreach; the CPU's is not
    tracker = MemTracker()
    tracker.track_external(model, opt, a, b)
    with tracker:
        probe = CpuProbe(tracker, cublas)
        with probe:
            step(model, opt, a, b)
    peak = max(tracker._peak_mem.values())
    return probe.log, peak


def _trace_vram(setup: Callable[..., Any], step: Callable[..., Any],
                arch: tuple[int, int]) -> tuple[list[Any], int, int, list[int]]:
    with simulated_cuda(gpu="80GiB", major=arch[0], minor=arch[1]):
        model, opt, a, b = setup("cuda", None)  # default: Adam picks foreach for CUDA parameters
        torch.cuda.reset_peak_memory_stats()
        probe = VramProbe()
        with probe:
            step(model, opt, a, b)
        return probe.log, torch.cuda.max_memory_allocated(), probe.peak_seen, probe.scratch


def hf_setup(device: str, foreach: bool | None, kind: str) -> tuple[Any, ...]:
    """The corpus's Hugging Face models (tests/corpus/hf_gpt2.py, hf_llama_gqa.py: GPT-2, and
    Llama with 8 query and 2 KV heads), AdamW, a left-padded attention mask. Eager attention: with
    ``sdpa`` the CPU takes the math kernel for a masked call where CUDA takes the memory-efficient
    one, so the two runs would not hold the same tensors. No dropout, for the same reason: CUDA
    takes the fused ``native_dropout`` (Dropout.cpp ``is_fused_kernel_acceptable``), the CPU
    ``empty_like`` + ``bernoulli_``."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=2000, n_positions=128, bos_token_id=1, eos_token_id=2,
            attn_implementation="eager", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=2000, max_position_embeddings=256, attn_implementation="eager"))
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    ids = torch.randint(3, 2000, (2, 64), device=device)
    mask = torch.ones_like(ids)
    mask[0, :8] = 0
    return model, opt, ids, mask


def hf_step(model: Any, opt: Any, ids: Any, mask: Any) -> None:
    model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


CASES = {"transformer": (gpt_setup, gpt_step), "cnn": (cnn_setup, cnn_step),
         "hf_gpt2": (functools.partial(hf_setup, kind="gpt2"), hf_step),
         "hf_llama_gqa": (functools.partial(hf_setup, kind="llama"), hf_step)}


@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_vram_equals_memtracker_plus_allocator_terms(case: str, arch: tuple[int, int]) -> None:
    setup, step = CASES[case]
    cpu, mt_peak = _trace_cpu(setup, step, CUBLAS[arch])
    gpu, vram_peak, vram_peak_at_op_end, scratch = _trace_vram(setup, step, arch)

    # the same ops, in the same order (SDPA: CPU flash kernel <-> CUDA memory-efficient kernel)
    assert [SDPA_CPU_TO_CUDA.get(op, op) for op, _, _ in cpu] == [op for op, _, _ in gpu]
    # op by op: vram = MemTracker - host tensors + workspaces + block tails, exactly
    expected = [mt + ws + tails for (_, mt, ws), (_, _, tails) in zip(cpu, gpu)]
    assert [alloc for _, alloc, _ in gpu] == expected
    # and so the peak at the end of an op; within an op, the bias gradients' reduction scratch
    assert vram_peak_at_op_end == max(expected)
    assert vram_peak == max([*expected, *(alloc + s for (_, alloc, _), s in zip(gpu, scratch))])
    # MemTracker's own peak (host tensors included) is the largest tensor total of the step
    assert mt_peak >= max(mt for _, mt, _ in cpu)


def test_transformer_figures_sm80() -> None:
    """The figures quoted in docs/estimate-accuracy.md (sm80, TinyGPT, one Adam step)."""
    cpu, mt_peak = _trace_cpu(gpt_setup, gpt_step, CUBLAS[(8, 0)])
    gpu, vram_peak, at_op_end, _ = _trace_vram(gpt_setup, gpt_step, (8, 0))
    k = max(range(len(gpu)), key=lambda i: gpu[i][1])  # the op where vram peaks
    op, mt, ws = cpu[k]
    assert (mt_peak, at_op_end, vram_peak) == (56_875_008, 70_506_496, 71_554_560)
    # vram's peak at the end of an op: the first backward matmul (the LM head's grad), where the
    # autograd thread's cuBLAS workspace joins the forward thread's and its cuBLASLt workspace
    assert op == "aten.mm.default" and mt == 50_583_552
    assert ws == 2 * CUBLAS[(8, 0)] + CUBLASLT == 18_087_936
    assert gpu[k][2] == 1_835_008 == at_op_end - mt - ws
    # its peak within an op: the first 1024-wide bias gradient, sum(0) of [1024, 1024], whose
    # launch stages 8 MiB + 512 B on top of what is allocated when it returns
    j = next(i for i, (o, a, _) in enumerate(gpu) if a + 8 * MiB + 512 == vram_peak)
    assert gpu[j][0] == "aten.sum.dim_IntList"
