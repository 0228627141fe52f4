"""The PrivateUse1 engine as ``vram run``'s default for one GPU: CUDA's own kernels run
whole, lazy host tensors leave no dispatch mode behind, and paths that once failed under it.

Each expected sequence is read off the CUDA kernel's launch code, cited per test; sizes are the
requests in bytes (fp32)."""
from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")
nn = pytest.importorskip("torch.nn")

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode  # noqa: E402

from vram.run.runtime import active_sim, default_backend, simulated_cuda  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch._C, "_acc"), reason="needs torch._C._acc (Python PrivateUse1)")


def r512(n: int) -> int:
    return -(-n // 512) * 512


def _allocs(fn) -> list[int]:  # type: ignore[no-untyped-def]
    """Requested sizes of the allocations `fn` makes, in order (the snapshot trace's ``alloc``
    entries carry the request, ``orig_size`` in CUDACachingAllocator.cpp)."""
    torch.cuda.memory._record_memory_history()
    fn()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    return [e["size"] for e in trace if e["action"] == "alloc"]


def test_every_run_defaults_to_privateuse1(monkeypatch: pytest.MonkeyPatch) -> None:
    """One GPU or several, one process or a rank: the PrivateUse1 engine; meta only by name."""
    monkeypatch.delenv("VRAM_RUN_BACKEND", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert default_backend(1) == default_backend(2) == default_backend(8) == "privateuse1"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert default_backend(1) == default_backend(2) == "privateuse1"
    monkeypatch.setenv("VRAM_RUN_BACKEND", "meta")
    assert default_backend(2) == "meta"


def test_layer_norm_is_cudas_kernel() -> None:
    """``layer_norm_cuda`` (layer_norm_kernel.cu): Y = empty_like(X), mean and rstd of M floats;
    the math composite other backends get would add an input-sized temporary."""
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        x = torch.randn(8, 128, 256, device="cuda")
        ln = nn.LayerNorm(256).cuda()
        assert _allocs(lambda: ln(x)) == [8 * 128 * 256 * 4, 1024 * 4, 1024 * 4]


def test_rms_norm_is_cudas_fused_kernel() -> None:
    """``_fused_rms_norm`` has a CUDA kernel (native_functions.yaml): Y = empty_like(X), rstd of M
    floats; elsewhere its CompositeImplicitAutograd upcasts, squares and means in steps."""
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        x = torch.randn(8, 128, 256, device="cuda", requires_grad=True)
        norm = nn.RMSNorm(256).cuda()
        assert _allocs(lambda: norm(x)) == [8 * 128 * 256 * 4, 1024 * 4]
        norm(x).sum().backward()
        assert x.grad is not None and norm.weight.grad is not None


def test_group_norm_makes_a_channels_last_input_contiguous_as_cuda_does() -> None:
    """group_norm.cpp: ``is_cpu() || is_privateuseone() ? contiguous(memory_format) : contiguous()``;
    CUDA copies a channels-last input to NCHW, then ``native_group_norm``: Y, mean and rstd of
    N x groups floats."""
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        x = torch.randn(2, 64, 8, 8, device="cuda").to(memory_format=torch.channels_last)
        gn = nn.GroupNorm(32, 64).cuda()
        n = 2 * 64 * 8 * 8 * 4
        assert _allocs(lambda: gn(x)) == [n, n, 2 * 32 * 4, 2 * 32 * 4]


def test_lazy_host_model_moves_and_leaves_no_dispatch_mode() -> None:
    """A CPU-built model is lazy (no bytes) while it lives on the host; once moved, no dispatch
    mode is left for autograd to see (TensorSubclassLikeUtils.h)."""
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024, bias=False))
        w = m[0].weight
        assert active_sim().host.of(w) is not None and w.device.type == "cpu"
        assert _get_current_dispatch_mode() is not None
        m.to("cuda")
        assert w is m[0].weight and w.is_cuda
        assert torch.cuda.memory_allocated() == r512(1024 * 1024 * 4) * 2 + r512(1024 * 4)
        m(torch.randn(4, 1024, device="cuda")).sum().backward()
        assert _get_current_dispatch_mode() is None
    assert _get_current_dispatch_mode() is None


def test_a_scripts_dispatch_mode_and_host_data_to_the_gpu() -> None:
    """``torch.tensor(data, device=)`` builds below the Python key while a script's dispatch mode
    is on the stack: a Python *fallback* then fails (python_dispatch.cpp, ``func != nullptr``)."""
    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        with Passthrough():
            t = torch.tensor([1.0, 2.0], device="cuda")
        assert t.is_cuda and t.tolist() == [1.0, 2.0]


def test_checkpoint_loaded_to_the_gpu_vector_linear_and_grad_scaler() -> None:
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        buf = io.BytesIO()
        torch.save({"w": torch.ones(1000, 1000)}, buf)
        buf.seek(0)
        sd = torch.load(buf, map_location="cuda")
        assert sd["w"].is_cuda and torch.cuda.memory_allocated() == r512(4_000_000)
        lin = nn.Linear(16, 32, bias=False).cuda()
        y = lin(torch.randn(16, device="cuda"))  # mv: its meta kernel checks its inputs' storages
        assert y.shape == (32,)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        scaler.scale(y.sum()).backward()
        scaler.step(opt)  # _amp_foreach_non_finite_check_and_unscale_ returns nothing
        scaler.update()


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_half_softmax_to_float_is_one_kernel(backend: str) -> None:
    """SoftMax.cpp: on CUDA, ``softmax(half, dtype=float32)`` is ``_softmax(x, dim,
    half_to_float=True)``: the float output only, no float copy of the input (autocast's
    fp32_set_opt_dtype asks for exactly this); its backward's gradient is half."""
    with simulated_cuda(gpu="24GiB", backend=backend):
        x = torch.randn(4, 8, 128, 128, device="cuda", dtype=torch.float16, requires_grad=True)
        out = 4 * 8 * 128 * 128 * 4

        def forward() -> None:
            forward.y = torch.softmax(x, -1, dtype=torch.float32)  # type: ignore[attr-defined]
            with torch.autocast("cuda", dtype=torch.float16):
                forward.z = torch.nn.functional.log_softmax(x, dim=-1)  # type: ignore[attr-defined]
        assert _allocs(forward) == [out, out]
        assert forward.y.dtype == forward.z.dtype == torch.float32  # type: ignore[attr-defined]
        forward.y.sum().backward()  # type: ignore[attr-defined]
        assert x.grad is not None and x.grad.dtype == torch.float16


@pytest.mark.parametrize("reduction", ["max", "min", "median", "nanmedian"])
def test_full_reduction_backward_takes_cudas_branch(reduction: str) -> None:
    """``evenly_distribute_backward`` (FunctionsManual.cpp) branches on ``input.is_cuda()``; its
    CUDA branch, read off the source for N fp32 inputs (after ``backward()``'s seed gradient, a
    0-dim fp32 ``ones``: 4 bytes): isnan(input) N bytes, isnan(value) 1,
    ``input == value`` N, ``mask.sum()`` an int64 output then the bool→int64 copy ``make_reduction``
    reduces (ReduceOpsUtils.h), ``grad / sum`` 4, ``mask * …`` 4N. The CPU branch PrivateUse1
    would take reads ``value.isnan().item()`` and fills ``new_zeros``."""
    n = 64 * 64
    with simulated_cuda(gpu="A100-80GB", backend="privateuse1"):
        x = torch.randn(64, 64, device="cuda", requires_grad=True)
        y = getattr(x, reduction)()
        assert _allocs(y.backward) == [4, n, 1, n, 8, 8 * n, 4, 4 * n]
        assert type(y.grad_fn).__name__ == "_EvenlyDistributedBackward"
        with torch.no_grad():
            assert getattr(x, reduction)().grad_fn is None
        assert x.grad is not None and x.grad.shape == x.shape and x.grad.device.type == "cuda"


def test_mish_backward_is_cudas_kernel() -> None:
    """``mish_backward`` has a CUDA kernel (Activation.cpp: one ``grad_input`` of the input's
    size); PrivateUse1 would get the composite ``math_mish_backward``'s temporaries."""
    with simulated_cuda(gpu="24GiB", backend="privateuse1"):
        x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        y = nn.functional.mish(x)
        g = torch.ones_like(y)
        assert _allocs(lambda: y.backward(g)) == [4 << 20]


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_inference_batch_norm_is_cudnns(backend: str) -> None:
    """``_batch_norm_impl_index`` sends inference batch norm to ``cudnn_batch_norm`` when
    ``_select_batch_norm_backend`` allows it; in inference that returns ``save_mean``/``save_var``
    as ``empty({0})`` (cudnn/BatchNorm.cpp): the output is the only allocation. A bfloat16
    input takes the native kernel, which allocates both [C] statistics in float. Both engines."""
    with simulated_cuda(gpu="24GiB", backend=backend):
        bn = nn.BatchNorm2d(8).cuda().eval()
        x = torch.randn(4, 8, 5, 5, device="cuda")
        with torch.no_grad():
            assert _allocs(lambda: bn(x)) == [4 * 8 * 25 * 4]
            xb, bnb = x.bfloat16(), nn.BatchNorm2d(8).cuda().eval().bfloat16()
            assert _allocs(lambda: bnb(xb)) == [4 * 8 * 25 * 2, 8 * 4, 8 * 4]
        x.requires_grad_(True)
        bn(x).sum().backward()  # eval backward reads the running statistics, not save_*
        assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_small_inference_batch_norm_runs(backend: str) -> None:
    """Values of small tensors are known: the CPU kernel's eval statistics are
    [0]-shaped, unlike the simulated output's, which once stopped every CNN in eval mode."""
    with simulated_cuda(gpu="24GiB", backend=backend):
        bn = nn.BatchNorm2d(8).cuda().eval()
        with torch.no_grad():
            y = bn(torch.ones(2, 8, 3, 3, device="cuda"))
        assert y.shape == (2, 8, 3, 3)


def test_vram_run_names_cudnn_scratch_it_leaves_out(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from vram.run.runtime import run_script

    script = tmp_path / "cnn.py"
    script.write_text("import torch\n"
                      "m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).cuda()\n"
                      "m(torch.randn(2, 3, 16, 16, device='cuda')).sum().backward()\n"
                      "m.eval()\n"
                      "with torch.no_grad():\n"
                      "    m(torch.randn(2, 3, 16, 16, device='cuda'))\n")
    assert run_script(str(script), [], gpu="24GiB") == 0
    err = capsys.readouterr().err
    # convolution forward, backward (grad_weight only), eval forward; batch norm in training forward
    # and backward (inference has no workspace): shapes the measured sm90 table does not hold
    assert "5 call(s) with cuDNN workspaces (convolution, batch norm) of calls not in" in err


@pytest.mark.parametrize("backend", ["privateuse1", "meta"])
def test_embedding_backwards_sort_path_names_cub_storage_as_uncharged(backend: str) -> None:
    """Embedding.cu ``embedding_dense_backward_cuda``: up to 3,072 indices without
    ``scale_grad_by_freq`` it launches one kernel into ``grad_weight``; beyond, it sorts the
    indices with cub, whose temporary storage is sized by the GPU's cub tuning (charged scratch:
    tests/test_kernel_scratch.py), so a run names those calls rather than keep silent."""
    from vram.run.runtime import active_sim

    with simulated_cuda(gpu="24GiB", backend=backend):
        emb = nn.Embedding(1000, 64).cuda()
        emb(torch.zeros(4, 768, dtype=torch.long, device="cuda")).sum().backward()   # 3,072 indices
        sim = active_sim()
        assert sim is not None and not any("embedding" in what for what in sim.uncharged)
        emb(torch.zeros(4, 769, dtype=torch.long, device="cuda")).sum().backward()
        assert sum(n for what, n in sim.uncharged.items() if "embedding_dense_backward" in what) == 1
