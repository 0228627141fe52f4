"""`vram run` / `vram.run.runtime`: unmodified PyTorch code on a simulated CUDA GPU.

Expected figures come from the allocator spec (shared/spec/pytorch-allocator.md: §4 rounding —
512-byte multiples; §6 segment sizes — 2 MiB for ≤ 1 MiB, 20 MiB below 10 MiB; §15.1 the OOM
text) and from PyTorch's CUDA sources as cited (cuBLAS workspaces: aten/src/ATen/cuda/
CublasHandlePool.cpp; flash attention: aten/src/ATen/native/transformers/cuda/flash_attn/
flash_api.cpp), never from printing this module's output.
"""
from __future__ import annotations

import inspect
import os
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from vram import cli  # noqa: E402
from vram.run.runtime import DataDependentError, simulated_cuda  # noqa: E402

MiB = 1024 * 1024
GiB = 1024 * MiB
CUBLAS_SM90 = 4096 * 8 * 1024          # getChosenWorkspaceSize() default on sm90
CUBLAS_OTHER = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8" elsewhere: 8,519,680 B
CUBLASLT = 1024 * 1024                 # CUBLASLT_WORKSPACE_SIZE default: 1024 KiB


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)


def test_factory_is_a_cuda_tensor_charged_to_the_allocator() -> None:
    with simulated_cuda(gpu="24GiB"):
        x = torch.randn(1024, 1024, device="cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1
        assert torch.cuda.memory_allocated() == 4 * MiB      # 4 MiB: already a 512 multiple
        assert torch.cuda.memory_reserved() == 20 * MiB      # 1 MiB < 4 MiB < 10 MiB: 20 MiB segment
        assert x.data_ptr() != 0
        y = torch.zeros(100, device=x.device)               # device taken from a tensor
        assert y.is_cuda and torch.cuda.memory_allocated() == 4 * MiB + 512
    assert not torch.cuda.is_available()                     # torch.cuda restored (CPU build)


def test_alias_keeps_memory_del_frees_empty_cache_releases() -> None:
    with simulated_cuda():
        x = torch.empty(1024, 1024, device="cuda")
        y = x.view(-1)[:10]
        del x
        assert torch.cuda.memory_allocated() == 4 * MiB      # the view keeps the storage alive
        del y
        assert torch.cuda.memory_allocated() == 0
        assert torch.cuda.memory_reserved() == 20 * MiB      # cached, not returned
        torch.cuda.empty_cache()
        assert torch.cuda.memory_reserved() == 0


def test_autograd_saved_tensor_lives_until_the_graph_dies() -> None:
    with simulated_cuda():
        a = torch.empty(1024, 1024, device="cuda", requires_grad=True)
        b = a.exp()                                          # exp saves its result for backward
        c = b.sum()
        del b
        assert torch.cuda.memory_allocated() == 8 * MiB + 512
        del c                                                # the graph, and the saved result, die
        assert torch.cuda.memory_allocated() == 4 * MiB


def test_module_cuda_and_to() -> None:
    with simulated_cuda():
        lin = nn.Linear(1024, 1024).cuda()
        assert lin.weight.device.type == "cuda"
        # weight 4 MiB in a 20 MiB segment, bias 4096 B in a 2 MiB small segment
        assert torch.cuda.memory_allocated() == 4 * MiB + 4096
        assert torch.cuda.memory_reserved() == 20 * MiB + 2 * MiB
        assert lin.cuda() is lin and torch.cuda.memory_allocated() == 4 * MiB + 4096
        lin2 = nn.Linear(1024, 1024).to("cuda")
        assert torch.cuda.memory_allocated() == 2 * (4 * MiB + 4096)
        del lin2


def test_forward_allocates_output_and_first_matmul_cublas_workspaces() -> None:
    with simulated_cuda():
        lin = nn.Linear(1024, 1024).cuda()
        x = torch.randn(64, 1024, device="cuda")
        out_bytes = 64 * 1024 * 4
        a0 = torch.cuda.memory_allocated()
        y1 = lin(x)
        # addmm with a 1-D bias takes the cuBLASLt path: output, cuBLAS and cuBLASLt workspaces
        assert torch.cuda.memory_allocated() - a0 == out_bytes + CUBLAS_SM90 + CUBLASLT
        a1 = torch.cuda.memory_allocated()
        y2 = lin(x)
        assert torch.cuda.memory_allocated() - a1 == out_bytes   # workspaces are kept and reused
        del y1, y2
        assert torch.cuda.memory_allocated() == a0 + CUBLAS_SM90 + CUBLASLT
        torch.cuda.empty_cache()                                   # does not free workspaces
        assert torch.cuda.memory_allocated() == a0 + CUBLAS_SM90 + CUBLASLT


def test_cublas_workspace_size_off_hopper() -> None:
    with simulated_cuda(major=8, minor=0):
        a = torch.empty(64, 64, device="cuda")
        before = torch.cuda.memory_allocated()
        b = a @ a                                              # mm: no cuBLASLt workspace
        assert torch.cuda.memory_allocated() - before == 64 * 64 * 4 + CUBLAS_OTHER
        del b


def test_backward_creates_grads_and_a_second_workspace() -> None:
    with simulated_cuda():
        lin = nn.Linear(1024, 1024).cuda()
        x = torch.randn(64, 1024, device="cuda")
        lin(x)                                                 # forward workspaces out of the way
        a0 = torch.cuda.memory_allocated()
        lin(x).sum().backward()
        assert lin.weight.grad.shape == (1024, 1024) and lin.weight.grad.is_cuda
        assert lin.bias.grad.shape == (1024,)
        # grads (4 MiB + 4096) and the cuBLAS workspace of the autograd engine's thread; the
        # output, the loss and every intermediate are freed
        assert torch.cuda.memory_allocated() - a0 == 4 * MiB + 4096 + CUBLAS_SM90


def test_oom_is_torch_out_of_memory_error_with_pytorchs_text() -> None:
    with simulated_cuda(gpu="1GiB"):
        keep = torch.empty(1024, device="cuda")
        with pytest.raises(torch.OutOfMemoryError) as info:
            torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        assert isinstance(info.value, torch.cuda.OutOfMemoryError) and isinstance(info.value, RuntimeError)
        assert str(info.value) == (
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 1024.00 MiB "
            "of which 1022.00 MiB is free. Of the allocated memory 4.00 KiB is allocated by PyTorch, and "
            "2.00 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
            "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
            "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)")
        assert torch.cuda.memory_stats()["num_ooms"] == 1
        assert torch.cuda.memory_allocated() == 4096
        del keep


def test_item_print_and_host_copies_raise_naming_the_line() -> None:
    with simulated_cuda(strict_values=True):
        # values that need the GPU's arithmetic: a sum over 262,144 random elements (more than
        # vram.run.values.known keeps on the host), so unknown
        x = torch.randn(512, 512, device="cuda").sum()
        line = inspect.currentframe().f_lineno + 2  # type: ignore[union-attr]
        with pytest.raises(DataDependentError) as info:
            x.item()
        assert str(info.value) == (f"{__file__}:{line}: x.item() needs tensor values, which a "
                                   "simulated GPU does not have")
        for fn in (lambda: bool(x), lambda: print(x), lambda: x.cpu(), lambda: x.to("cpu"),
                   lambda: x.tolist(), lambda: torch.nonzero(x.expand(3))):
            with pytest.raises(DataDependentError, match=os.path.basename(__file__)):
                fn()
        assert torch.ones(3).sum().item() == 3.0                # host tensors keep their values


def test_sdpa_takes_the_flash_path_without_the_attention_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")  # sm90 prefers cuDNN attention otherwise
    with simulated_cuda():
        b, h, s, d = 4, 8, 1024, 64
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # mha_fwd: out, softmax_lse float32 [B, H, S], rng_state uint64[2], an unused uint64: no
        # B*H*S*S probabilities (the math path's 128 MiB here); B*H*ceil(S/64) = 512 blocks fill
        # the 264 SM slots, so no split-KV accumulators
        expected = b * h * s * d * 2 + b * h * s * 4 + 512 + 512
        assert torch.cuda.memory_allocated() - a0 == expected
        assert torch.cuda.max_memory_allocated() - a0 == expected
        assert o.dtype == torch.bfloat16 and o.shape == q.shape
        o.sum().backward()
        assert q.grad.shape == q.shape and v.grad.is_cuda


def test_flash_split_kv_accumulators_are_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")  # sm90 prefers cuDNN attention otherwise
    with simulated_cuda():
        q = torch.randn(1, 12, 1024, 64, device="cuda", dtype=torch.float16)
        a0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        o = F.scaled_dot_product_attention(q, q, q)
        # num_splits_heuristic(1*12*16=192 blocks < 0.8*2*132, 4 key blocks of 256) = 4 splits:
        # softmax_lse_accum [4,1,12,1024] f32 and out_accum [4,1,12,1024,64] f32, freed at the end
        out, lse = 12 * 1024 * 64 * 2, 12 * 1024 * 4
        assert torch.cuda.max_memory_allocated() - a0 == out + lse + 4 * lse + 4 * 12 * 1024 * 64 * 4 + 1024
        # no grad needed: nothing saves logsumexp or the rng state, they die with the op's tuple
        assert torch.cuda.memory_allocated() - a0 == out
        del o


def test_autocast_casts_and_caches_weight_copies() -> None:
    with simulated_cuda():
        lin = nn.Linear(1024, 1024).cuda()
        x = torch.randn(8, 1024, device="cuda")
        lin(x)                                                 # workspaces out of the way
        a0 = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y1 = lin(x)
            assert y1.dtype == torch.bfloat16
            # bias and weight cast to bf16 (cached), input cast, bf16 output
            assert torch.cuda.memory_allocated() - a0 == 2048 + 2 * MiB + 16384 + 16384
            a1 = torch.cuda.memory_allocated()
            y2 = lin(x)
            assert torch.cuda.memory_allocated() - a1 == 16384 + 16384   # weight copies reused
            assert F.softmax(y2, dim=-1).dtype == torch.float32
            assert F.layer_norm(y2, (1024,)).dtype == torch.float32
        with pytest.warns(FutureWarning), torch.cuda.amp.autocast():   # deprecated spelling
            assert (x @ x.T).dtype == torch.float16
        del y1, y2


def test_training_loop_reaches_a_steady_state() -> None:
    with simulated_cuda(gpu="16GiB"):
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256)).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        params = 256 * 512 * 4 + 512 * 4 + 512 * 256 * 4 + 256 * 4

        def step() -> None:
            x = torch.randn(128, 256, device="cuda")
            target = torch.randn(128, 256, device="cuda")
            F.mse_loss(model(x), target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        peaks = []
        for _ in range(3):
            torch.cuda.reset_peak_memory_stats()
            step()
            peaks.append(torch.cuda.max_memory_allocated())
        assert peaks[1] == peaks[2]
        # parameters + Adam's exp_avg and exp_avg_sq; grads are None; forward cuBLAS + cuBLASLt
        # workspaces and the backward thread's cuBLAS workspace stay
        assert torch.cuda.memory_allocated() == 3 * params + 2 * CUBLAS_SM90 + CUBLASLT


def test_two_devices() -> None:
    with simulated_cuda(device_count=2):
        x = torch.empty(1024, 1024, device="cuda:1")
        assert x.device == torch.device("cuda", 1)
        assert (torch.cuda.memory_allocated(0), torch.cuda.memory_allocated(1)) == (0, 4 * MiB)
        y = x.to("cuda:0")
        assert y.device.index == 0 and torch.cuda.memory_allocated(0) == 4 * MiB


def _script(tmp_path: os.PathLike[str], body: str) -> str:
    path = os.path.join(os.fspath(tmp_path), "script.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent(body))
    return path


def test_vram_run_cli_passes_args_and_reports(tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]) -> None:
    path = _script(tmp_path, """\
        import sys
        import torch
        n = int(sys.argv[1])
        x = torch.empty(n, n, device="cuda")
        print("args", sys.argv[1:], "allocated", torch.cuda.memory_allocated(), __name__)
        """)
    assert cli.main(["run", "--gpu", "2GiB", "--summary", path, "1024", "--flag"]) == 0
    out = capsys.readouterr().out
    assert f"args ['1024', '--flag'] allocated {4 * MiB} __main__" in out
    assert "PyTorch CUDA memory summary, device ID 0" in out
    assert sys.argv[0] != path


def test_vram_run_oom_and_values(tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]) -> None:
    path = _script(tmp_path, """\
        import torch
        x = torch.empty(3 * 1024**3, dtype=torch.uint8, device="cuda")
        """)
    assert cli.main(["run", "--gpu", "2GiB", path]) == 1
    err = capsys.readouterr().err
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB." in err
    assert 'script.py", line 2, in <module>' in err and "torch_run.py" not in err
    path = _script(tmp_path, """\
        import torch
        loss = torch.randn(512, 512, device="cuda").mean()
        print(loss.item())
        """)
    assert cli.main(["run", "--strict-values", path]) == 1
    assert "script.py:3: loss.item() needs tensor values" in capsys.readouterr().err


def test_vram_run_arch_flag_sets_the_cublas_workspace(tmp_path, capsys):
    """pytorch/pytorch#95668 (A10G, sm86): after one Linear(1, 1) call on CUDA,
    torch.cuda.memory_allocated() stays at 8,519,680 — the cuBLAS workspace (4096 KiB x 2 +
    16 KiB x 8 below sm90); an sm90 GPU's default workspace is 4096 KiB x 8 = 32 MiB."""
    from vram.cli.commands import main
    from vram.devices.gpus import parse_arch

    script = tmp_path / "lin.py"
    script.write_text(
        "import torch\n"
        "lin = torch.nn.Linear(1, 1).cuda()\n"
        "x = torch.ones(1, 1, device='cuda')\n"
        "lin(x)\n"
        "del lin, x\n"
        "print(torch.cuda.memory_allocated(), torch.cuda.get_device_capability())\n")
    assert main(["run", "--arch", "sm_86", str(script)]) == 0
    out = capsys.readouterr().out.split()
    assert out[0] == "8519680"
    assert main(["run", str(script)]) == 0
    # sm90: the 32 MiB cuBLAS workspace only — addmm's cuBLASLt path (and its 1 MiB workspace)
    # needs every matrix dimension > 1 (Blas.cpp isInputCompliesAddmmCudaLt); Linear(1, 1) has 1s
    assert int(capsys.readouterr().out.split()[0]) == 32 * 1024 * 1024
    assert parse_arch("8.0") == (8, 0) and parse_arch("sm90") == (9, 0)
    assert main(["run", "--arch", "x", str(script)]) == 2


# -- Python code the autograd engine runs: checkpoint recomputation, custom backward, hooks -------

def _checkpoint_deltas(use: str) -> tuple[int, int]:
    """(allocated after forward, after backward) minus before, for Linear→GELU→Linear on 256×1024."""
    from torch.utils.checkpoint import checkpoint
    block = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)).cuda()
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        y = block(x) if use == "none" else checkpoint(block, x, use_reentrant=use == "reentrant")
        return y, y.sum()

    y, loss = step()
    loss.backward()  # warm-up: cuBLAS workspaces of both threads exist from here on
    del y, loss
    x.grad = None
    block.zero_grad(set_to_none=True)
    before = torch.cuda.memory_allocated()
    y, loss = step()
    forward = torch.cuda.memory_allocated() - before
    loss.backward()
    return forward, torch.cuda.memory_allocated() - before


@pytest.mark.parametrize("use", ["none", "non-reentrant", "reentrant"])
def test_checkpoint_keeps_only_the_block_output(use: str) -> None:
    # float32, every size a 512 multiple (§4): x, the two Linear outputs and GELU's are 1 MiB each,
    # the scalar loss 512 B. Without checkpoint the forward keeps Linear1's output (GELU saves its
    # input) and GELU's output (Linear2 saves its input for the weight gradient); with either
    # checkpoint flavour only the block's output. After backward, every variant holds y, the loss,
    # x.grad and the parameters' gradients (2 × 4 MiB weights + 2 × 4 KiB biases).
    grads = 2 * 4 * MiB + 2 * 4096 + MiB
    with simulated_cuda():
        forward, backward = _checkpoint_deltas(use)
    assert forward == (3 * MiB if use == "none" else MiB) + 512
    assert backward == MiB + 512 + grads


def test_checkpoint_recomputes_under_autocast_and_flash_attention() -> None:
    # PyTorch compares every tensor the recomputation saves with the forward's (shape, dtype,
    # device) and raises CheckpointError on a mismatch: the recomputation, run by the autograd
    # engine, must see the same emulated autocast casts and SDPA routing as the forward did.
    from torch.utils.checkpoint import checkpoint

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(256, 768), nn.Linear(256, 256)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 4, 64).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.out(y.transpose(1, 2).reshape(b, t, d))

    with simulated_cuda():
        blocks = nn.ModuleList(Attention() for _ in range(3)).cuda()
        x = torch.randn(8, 512, 256, device="cuda", requires_grad=True)
        before = torch.cuda.memory_allocated()
        for use_reentrant in (False, True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                h = x
                for blk in blocks:
                    h = checkpoint(blk, h, use_reentrant=use_reentrant)
            # kept: each block's float32 output (x + bf16 → float32), 8·512·256·4 B = 4 MiB; the
            # weights' bf16 copies went with the autocast cache when autocast exited. Kept too:
            # the cuBLAS and cuBLASLt (bf16 matmul) workspaces of the main thread, made by the
            # first forward, and of the autograd thread, made by the first backward.
            assert h.dtype == torch.float32
            workspaces = (CUBLAS_SM90 + CUBLASLT) * (2 if use_reentrant else 1)
            assert torch.cuda.memory_allocated() - before == 3 * 4 * MiB + workspaces
            h.sum().backward()
            assert all(p.grad is not None and p.grad.is_cuda for p in blocks.parameters())
            del h
            x.grad = None
            blocks.zero_grad(set_to_none=True)


def test_custom_backward_and_tensor_hooks_see_the_simulated_gpu() -> None:
    seen: list[int] = []

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            before = torch.cuda.memory_allocated()
            extra = torch.zeros(1000, device="cuda")   # a CUDA factory inside backward
            seen.append(torch.cuda.memory_allocated() - before)
            assert extra.is_cuda
            return g * 2

    with simulated_cuda():
        x = torch.ones(1024, device="cuda", requires_grad=True)
        y = Scale.apply(x)
        y.register_hook(lambda g: seen.append(int(g.is_cuda)) or None)
        y.sum().backward()
    assert seen == [1, 4096]  # the hook ran first; 4,000 B → a 4,096-byte block (§4)


def test_vram_run_gpu_preset(tmp_path, capsys):
    """--gpu T4: the card as CUDA describes it (vram.devices.gpus; docs/gpus.md) — its name, compute
    capability 7.5 (so the 8,519,680-byte cuBLAS workspace of pytorch#95668, not sm90's 32 MiB),
    and the total capacity real Colab T4 OOM messages print: "14.74 GiB"."""
    from vram.cli.commands import main

    script = tmp_path / "t4.py"
    script.write_text(
        "import torch\n"
        "p = torch.cuda.get_device_properties(0)\n"
        "print(p.name, p.total_memory, torch.cuda.get_device_capability(), torch.cuda.mem_get_info()[1])\n"
        "lin = torch.nn.Linear(1, 1).cuda()\n"
        "lin(torch.ones(1, 1, device='cuda'))\n"
        "del lin\n"
        "print(torch.cuda.memory_allocated())\n"
        "x = torch.empty(15 * 2**30, dtype=torch.uint8, device='cuda')\n")
    assert main(["run", "--gpu", "T4", str(script)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == ["Tesla T4 15828320256 (7, 5) 15828320256", "8519680"]
    assert "Tried to allocate 15.00 GiB. GPU 0 has a total capacity of 14.74 GiB of which" in err


# -- torch.load onto the simulated GPU ------------------------------------------------------------

def _save(path: str, obj: object, location: str | None = None) -> None:
    """torch.save; with `location`, tag every storage as saved from that device, as a checkpoint
    written on a GPU is (the file format differs only in that string)."""
    if location is None:
        torch.save(obj, path)
        return
    import torch.serialization as ser
    original = ser.location_tag
    ser.location_tag = lambda storage: location
    try:
        torch.save(obj, path)
    finally:
        ser.location_tag = original


def test_torch_load_map_location_cuda_charges_each_storage_once(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    w = torch.zeros(1024, 1024)
    _save(path, {"w": w, "head": w[:10], "b": torch.zeros(100)})  # "head" shares w's storage
    with simulated_cuda():
        sd = torch.load(path, map_location="cuda", weights_only=True)
        assert all(t.is_cuda for t in sd.values())
        # 4 MiB for the shared storage, once, as torch.load keeps it for "head"; 400 B → 512 (§4)
        assert torch.cuda.memory_allocated() == 4 * MiB + 512
        st = sd["w"].untyped_storage()
        assert st.data_ptr() == sd["w"].data_ptr() == sd["head"].untyped_storage().data_ptr() != 0
        assert sd["b"].untyped_storage().data_ptr() != st.data_ptr()
        sd2 = torch.load(path, map_location=lambda storage, loc: storage.cuda(), weights_only=True)
        assert torch.cuda.memory_allocated() == 2 * (4 * MiB + 512)
        del sd, sd2, st
        assert torch.cuda.memory_allocated() == 0
        cpu = torch.load(path, map_location="cpu", weights_only=True)
        assert not cpu["w"].is_cuda and torch.cuda.memory_allocated() == 0


def test_checkpoint_saved_on_a_gpu_loads_onto_its_device(tmp_path) -> None:
    path = str(tmp_path / "gpu.pt")
    _save(path, {"w": torch.zeros(256, 1024)}, location="cuda:1")  # 1 MiB
    with simulated_cuda(device_count=2):
        sd = torch.load(path, weights_only=True)            # no map_location: back to cuda:1
        assert sd["w"].device == torch.device("cuda", 1)
        assert torch.cuda.memory_allocated(1) == MiB and torch.cuda.memory_allocated(0) == 0
        sd0 = torch.load(path, map_location={"cuda:1": "cuda:0"}, weights_only=True)
        assert sd0["w"].device == torch.device("cuda", 0) and torch.cuda.memory_allocated(0) == MiB
    with simulated_cuda(device_count=1):                     # PyTorch's own error for a missing GPU
        with pytest.raises(RuntimeError, match=r"device 1 but torch.cuda.device_count\(\) is 1"):
            torch.load(path, weights_only=True)


def test_multihead_attention_is_cast_and_routed_like_cuda() -> None:
    # nn.MultiheadAttention runs F.multi_head_attention_forward, a Python-level torch function:
    # its linear / SDPA / softmax calls must meet autocast and the SDPA routing as on a GPU.
    # need_weights=False: SDPA picks flash for bf16 with head dim 64, which never materializes the
    # B·H·S² scores (8·8·1024² bf16 = 128 MiB); the output is bf16 (autocast's linear).
    # need_weights=True: explicit baddbmm (bf16) then softmax, on autocast's float32 list, so the
    # returned head-averaged weights are float32.
    scores_bf16 = 8 * 8 * 1024 * 1024 * 2
    with simulated_cuda():
        m = nn.MultiheadAttention(512, 8, batch_first=True).cuda()
        x = torch.randn(8, 1024, 512, device="cuda", requires_grad=True)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, w = m(x, x, x, need_weights=False)
        assert y.dtype == torch.bfloat16 and w is None
        assert torch.cuda.max_memory_allocated() - before < scores_bf16
        y.float().sum().backward()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, w = m(x, x, x, need_weights=True)
        assert y.dtype == torch.bfloat16 and w.dtype == torch.float32 and w.shape == (8, 1024, 1024)


def test_autocast_norms_promote_and_normalize() -> None:
    # autocast_mode.cpp (CUDA): linalg_vector_norm is fp32_set_opt_dtype and norm fp32_append_dtype
    # (float32 results); addcmul is "promote" (widest input type); F.normalize divides its input
    # by such a norm, so a bf16 input comes back float32 on a GPU.
    with simulated_cuda():
        x = torch.randn(64, 512, device="cuda")
        lin = nn.Linear(512, 512).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = lin(x)
            assert h.dtype == torch.bfloat16
            assert h.norm(dim=-1).dtype == torch.float32
            assert torch.linalg.vector_norm(h).dtype == torch.float32
            assert torch.addcmul(h, h, h).dtype == torch.bfloat16
            assert torch.addcmul(h, x, x).dtype == torch.float32
            assert F.normalize(h, dim=-1).dtype == torch.float32
        assert F.normalize(h, dim=-1).dtype == torch.bfloat16  # autocast off: no casts


def test_autocast_runs_rms_norm_and_upsampling_in_float32() -> None:
    """torch 2.13's ``autocast_mode.h`` puts ``rms_norm``, ``native_layer_norm`` and the upsample
    ops (``upsample_nearest2d``, ``upsample_bilinear2d``, their ``_aa`` and exact forms ...) on
    CUDA's float32 list (``AT_FORALL_FP32``): a bf16 input is cast to a float32 copy, freed after
    the op, and the output is float32. ``F.interpolate`` reaches them by mode (torch/nn/functional.py;
    "area" is adaptive average pooling, not on the list)."""
    with simulated_cuda():
        x = torch.randn(2, 8, 16, 16, device="cuda").bfloat16()     # 8,192 B
        w = torch.ones(16, device="cuda")
        a0 = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.interpolate(x, scale_factor=2, mode="nearest")
            assert y.dtype == torch.float32
            # the float32 copy of x (16,384 B) and the output, 2·8·32·32·4 = 65,536 B; the copy dies
            assert torch.cuda.max_memory_allocated() - a0 == 16384 + 65536
            assert torch.cuda.memory_allocated() - a0 == 65536
            assert F.interpolate(x, scale_factor=2, mode="bilinear", antialias=True).dtype == torch.float32
            assert nn.Upsample(scale_factor=2, mode="bicubic")(x).dtype == torch.float32
            assert F.interpolate(x, scale_factor=0.5, mode="area").dtype == torch.bfloat16
            assert F.rms_norm(x, (16,), w).dtype == torch.float32
            assert nn.RMSNorm(16, device="cuda")(x).dtype == torch.float32
        assert F.interpolate(x, scale_factor=2).dtype == torch.bfloat16   # autocast off: no casts
        del y


def test_autocast_refuses_binary_cross_entropy_as_cuda_does() -> None:
    # autocast_mode.cpp registers binary_cross_entropy_banned for CUDA: an error, whatever the dtypes
    with simulated_cuda():
        p = torch.rand(8, device="cuda")
        y = torch.rand(8, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            with pytest.raises(RuntimeError, match="binary_cross_entropy and torch.nn.BCELoss are unsafe"):
                F.binary_cross_entropy(p, y)
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                nn.BCELoss()(p, y)
            F.binary_cross_entropy_with_logits(p, y)   # the safe one
        F.binary_cross_entropy(p, y)                    # outside autocast: fine


def test_nvtx_ranges_are_no_ops_with_nvtx_return_values() -> None:
    """Profiling scripts annotate with NVTX; a CPU build of torch has none (it raises)."""
    with simulated_cuda():
        assert torch.cuda.nvtx.range_push("forward") == 0   # zero-based depth of the new range
        assert torch.cuda.nvtx.range_push("attention") == 1
        assert torch.cuda.nvtx.range_pop() == 1             # depth of the range ended
        assert torch.cuda.nvtx.range_pop() == 0
        with torch.cuda.nvtx.range("step %d", 3):
            torch.empty(256, device="cuda")
        handle = torch.cuda.nvtx.range_start("io")
        torch.cuda.nvtx.range_end(handle)
        torch.cuda.nvtx.mark("here")
    with pytest.raises(RuntimeError, match="NVTX functions not installed"):
        torch.cuda.nvtx.range_push("outside")               # torch's own stub is back


def test_event_timing_is_zero_on_an_infinitely_fast_gpu() -> None:
    with simulated_cuda():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.empty(1024, device="cuda")
        end.record()
        end.synchronize()
        assert start.query() and start.elapsed_time(end) == 0.0


def test_autocast_casts_einsum_operands_left_to_right() -> None:
    """autocast_mode.h casts a TensorList with a plain loop, first operand first:
    the order decides which cached blocks the casts reuse."""
    with simulated_cuda():
        a = torch.randn(128, 256, device="cuda")   # bf16 copy: 65,536 B
        b = torch.randn(256, 64, device="cuda")    # bf16 copy: 32,768 B
        torch.cuda.memory._record_memory_history()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.einsum("ij,jk->ik", a, b)
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        sizes = [e["size"] for e in trace if e["action"] == "alloc"]
        assert sizes[:2] == [65536, 32768] and y.dtype == torch.bfloat16


def test_a_python_number_where_the_schema_wants_a_tensor() -> None:
    """``remainder``, ``fmod``, ``bitwise_and``, ``xlogy``, ``copysign`` with a Python number: the
    values and dtypes the CPU gives (RetinaNet's ``topk_idxs % num_classes``)."""
    ops = [lambda y: y % 3, lambda y: torch.fmod(y, 3), lambda y: y & 1, lambda y: torch.xlogy(y.float(), 2),
           lambda y: torch.copysign(y.float(), -1), lambda y: y.clone().remainder_(4), lambda y: y.half() % 2.5]
    cpu = [f(torch.arange(1, 10)) for f in ops]
    with simulated_cuda(gpu="24GiB"):
        y = torch.arange(1, 10, device="cuda")
        for f, ref in zip(ops, cpu):
            out = f(y)
            assert out.is_cuda and out.dtype == ref.dtype and out.tolist() == ref.tolist()
