"""`vram.estimate` / `vram estimate`: a training step's GPU memory, predicted on a simulated GPU.

Expected figures come from first principles — tensor sizes, the allocator's 512-byte rounding
(shared/spec/pytorch-allocator.md §4), which tensors autograd saves (PyTorch's
tools/autograd/derivatives.yaml: addmm saves mat1 only when mat2 needs a gradient and mat2 only when
mat1 does; relu saves its result), torch.optim.Adam's state (exp_avg and exp_avg_sq, each like the
parameter; ``step`` a CPU tensor when neither capturable nor fused, torch/optim/adam.py
``_init_group``), cuBLAS workspaces (aten/src/ATen/cuda/CublasHandlePool.cpp: 32 MiB per thread on
sm90; the 1 MiB cuBLASLt workspace of addmm with a bias) — never from printing this module's output.
"""
from __future__ import annotations

import io
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from vram import cli  # noqa: E402
from vram.estimate.engine import CATEGORIES, EstimateResult, estimate, fits, max_batch  # noqa: E402
from vram.run.runtime import simulated_cuda  # noqa: E402

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
CUBLAS_SM90 = 4096 * 8 * 1024   # one cuBLAS workspace per (thread, stream) on sm90
CUBLASLT = 1024 * 1024          # addmm with a 1-D bias: the cuBLASLt workspace (forward thread)
# forward thread: cuBLAS + cuBLASLt; the autograd engine's thread: a second cuBLAS workspace
WORKSPACES = 2 * CUBLAS_SM90 + CUBLASLT


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)


def r512(n: int) -> int:
    return (n + 511) // 512 * 512


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))


# Linear(1024, 4096) + Linear(4096, 1024), float32: every tensor's size is already a 512 multiple
PARAMS = r512(4096 * 1024 * 4) + r512(4096 * 4) + r512(1024 * 4096 * 4) + r512(1024 * 4)
B = 64


@pytest.fixture(scope="module")
def adam() -> EstimateResult:
    return estimate(mlp(), torch.empty(B, 1024), context=0)  # no CUDA context: peak_device_used = reserved


def test_mlp_adam_parameters_gradients_state(adam: EstimateResult) -> None:
    assert PARAMS == 33_574_912
    c = adam.categories
    assert adam.fits and adam.oom is None
    # batch 64 needs ~1.3 MiB of activations, while Adam's step holds parameters, gradients, both
    # moments and param-sized foreach temporaries at once: the steady peak is in the optimizer step
    assert adam.peak_at == {"iteration": 2, "phase": "optimizer"}
    assert c["parameters"] == PARAMS
    assert c["gradients"] == PARAMS
    assert c["optimizer_state"] == 2 * PARAMS       # exp_avg + exp_avg_sq; `step` lives on the CPU
    assert c["buffers"] == 0
    assert c["cublas_workspaces"] == WORKSPACES
    assert adam.peak_allocated >= c["parameters"] + c["gradients"] + c["optimizer_state"] + WORKSPACES
    # the categories partition allocated memory at the peak, plus the cache up to reserved
    assert sum(v for k, v in c.items() if k != "cache_fragmentation") == adam.peak_allocated
    assert 0 <= c["cache_fragmentation"] and sum(c.values()) <= adam.peak_reserved
    assert adam.peak_device_used == adam.peak_reserved       # no context, no other processes
    # between steps: parameters, both moments and the workspaces (grads were set to None)
    assert adam.resident == 3 * PARAMS + WORKSPACES
    assert adam.parameters_count == 4096 * 1024 + 4096 + 1024 * 4096 + 1024
    assert set(adam.categories) == set(CATEGORIES)


def test_forward_end_activations_are_the_saved_tensors(adam: EstimateResult) -> None:
    fe = adam.forward_end
    # linear1 saves its input x (for the weight's gradient), ReLU its result, linear2 its input
    # (the same ReLU result) and its weight (a parameter); linear1's output dies after ReLU
    assert fe["activations"] == r512(B * 1024 * 4) + r512(B * 4096 * 4)
    assert fe["parameters"] == PARAMS and fe["optimizer_state"] == 2 * PARAMS and fe["gradients"] == 0
    assert fe["temporaries"] == 512                             # the loss (a 0-d float32)
    # by module: x was made by the step (outside any module), the ReLU result by module "1"
    assert adam.forward_end_by_module == {"1": r512(B * 4096 * 4), "(outside any module)": r512(B * 1024 * 4)}
    assert adam.module_types["1"] == "ReLU"


def test_phases_first_and_steady(adam: EstimateResult) -> None:
    for label in ("first", "steady"):
        assert set(adam.phases[label]) == {"forward", "backward", "optimizer"}
    first, steady = adam.phases["first"], adam.phases["steady"]
    # the first forward runs before any optimizer state exists; later ones carry 2 x params
    assert steady["forward"]["peak_allocated"] - first["forward"]["peak_allocated"] >= 2 * PARAMS - CUBLAS_SM90
    assert adam.first_peak_allocated == max(p["peak_allocated"] for p in first.values())
    assert adam.peak_allocated == max(p["peak_allocated"] for p in steady.values())
    assert adam.peak_reserved == max(p["peak_reserved"] for p in steady.values())


def test_sgd_without_momentum_has_no_state() -> None:
    r = estimate(mlp(), torch.empty(B, 1024), optimizer="sgd")
    assert r.categories["optimizer_state"] == 0 and r.forward_end["optimizer_state"] == 0
    assert r.resident == PARAMS + WORKSPACES


def test_callable_optimizer_and_top_level_api() -> None:
    import vram

    # SGD with momentum keeps one momentum buffer per parameter, created at the first step
    r = vram.estimate(mlp(), torch.empty(B, 1024),
                      optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert r.categories["optimizer_state"] == PARAMS and r.resident == 2 * PARAMS + WORKSPACES
    assert vram.max_batch is max_batch and vram.EstimateResult is EstimateResult
    one = estimate(mlp(), torch.empty(B, 1024), iterations=1)  # no steady state: iteration 1 stands in
    assert one.peak_allocated == one.first_peak_allocated and one.phases["steady"] == one.phases["first"]


def test_no_optimizer_forward_backward_only() -> None:
    r = estimate(mlp(), torch.empty(B, 1024), optimizer=None)
    assert "optimizer" not in r.phases["steady"]
    assert r.resident == PARAMS + WORKSPACES                    # grads set to None after each step


def test_grad_accum_keeps_parameter_and_optimizer_memory(adam: EstimateResult) -> None:
    r = estimate(mlp(), torch.empty(B, 1024), grad_accum=4)
    assert r.categories["parameters"] == adam.categories["parameters"] == PARAMS
    assert r.categories["optimizer_state"] == adam.categories["optimizer_state"]
    assert r.resident == adam.resident
    assert r.settings["grad_accum"] == 4


def test_custom_step_matches_the_default_step(adam: EstimateResult) -> None:
    def step(model: nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    r = estimate(mlp(), torch.empty(B, 1024), step=step)
    assert r.peak_allocated == adam.peak_allocated and r.phases == adam.phases
    assert r.categories == adam.categories
    with pytest.raises(ValueError):
        estimate(mlp(), torch.empty(B, 1024), step=step, amp="bf16")


def test_checkpoint_keeps_only_block_inputs() -> None:
    def deep() -> nn.Module:
        return nn.Sequential(*[nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
                               for _ in range(6)])

    b = 2048  # activations (~120 MiB) outweigh parameters, gradients and workspaces
    inp, hidden = r512(b * 512 * 4), r512(b * 2048 * 4)
    plain = estimate(deep, torch.empty(b, 512), optimizer="sgd")
    ckpt = estimate(deep, torch.empty(b, 512), optimizer="sgd", checkpoint=True)
    # without: each block saves its input (first Linear) and its hidden ReLU result
    assert plain.forward_end["activations"] == 6 * inp + 6 * hidden
    # with: each checkpointed block keeps only its input until backward
    assert ckpt.forward_end["activations"] == 6 * inp
    # and the peak (start of backward) drops by most of the 6 hidden tensors, less the one block
    # being recomputed at a time and the recomputation's own transients
    assert ckpt.peak_allocated < plain.peak_allocated - 3 * hidden
    assert ckpt.settings["checkpoint"] is True


def test_checkpoint_policy_and_autocast_recomputation() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
                                        for _ in range(4))
            self.head = nn.Linear(512, 512)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    b = 256
    r = estimate(Net, torch.empty(b, 512), optimizer="sgd", amp="bf16", checkpoint=True)
    # the ModuleList's blocks are checkpointed, the head is not. Saved: block 0's float32 input,
    # blocks 1-3's bf16 inputs (autocast Linear outputs); the head saves its bf16 input copy
    # (already bf16: no copy, the same storage as block 3's output) and its bf16 weight copy
    saved = r512(b * 512 * 4) + 3 * r512(b * 512 * 2) + r512(b * 512 * 2) + r512(512 * 512 * 2)
    assert r.forward_end["activations"] == saved
    # the recomputation ran under the emulated autocast (else checkpoint raises CheckpointError)
    assert r.fits and r.phases["steady"]["backward"]["peak_allocated"] > 0
    # a module class picks the checkpointed modules instead: here the same four blocks
    by_class = estimate(Net, torch.empty(b, 512), optimizer="sgd", amp="bf16", checkpoint=nn.Sequential)
    assert by_class.forward_end == r.forward_end


def test_bf16_autocast_halves_matmul_activations(adam: EstimateResult) -> None:
    bf16 = estimate(mlp(), torch.empty(B, 1024), amp="bf16")
    fp32 = adam.forward_end_by_module
    by = bf16.forward_end_by_module
    assert by["1"] * 2 == fp32["1"]                             # ReLU of a bf16 matmul output
    # linear1 saves its input's bf16 copy (half of x); linear2 its bf16 weight copy (1024 x 4096)
    assert by["0"] == r512(B * 1024 * 2) and by["2"] == r512(4096 * 1024 * 2)
    assert bf16.forward_end["activations"] == fp32["1"] // 2 + r512(B * 1024 * 2) + r512(4096 * 1024 * 2)
    assert bf16.categories["parameters"] == PARAMS               # master weights stay float32


def test_fp16_adds_the_grad_scaler_state(adam: EstimateResult) -> None:
    r = estimate(mlp(), torch.empty(B, 1024), amp="fp16")
    # GradScaler: a float32 scale and an int32 growth tracker on the device, 512 B blocks each
    assert r.categories["optimizer_state"] == 2 * PARAMS + 2 * 512


def test_buffers_dict_inputs_and_model_untouched() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(256, 300)
            self.bn = nn.BatchNorm1d(300)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.bn(self.lin(x)) * scale

    net = Net()
    w = net.lin.weight.detach().clone()
    r = estimate(net, {"x": torch.empty(32, 256), "scale": 2.0})
    # running_mean, running_var (300 float32 each), num_batches_tracked (an int64 scalar)
    assert r.categories["buffers"] == 2 * r512(300 * 4) + 512
    assert r.categories["parameters"] == r512(256 * 300 * 4) + r512(300 * 4) + 2 * r512(300 * 4)
    assert net.lin.weight.device.type == "cpu" and torch.equal(net.lin.weight, w)
    assert r.inputs == ["x=32x256 float32"]


def test_factory_that_moves_to_cuda_itself() -> None:
    plain = estimate(lambda: nn.Linear(1024, 1024), torch.empty(8, 1024), optimizer="sgd")
    moved = estimate(lambda: nn.Linear(1024, 1024).cuda(), torch.empty(8, 1024), optimizer="sgd")
    # charged once, where the factory moves it: the same blocks as a meta build moved by estimate
    assert moved.categories["parameters"] == plain.categories["parameters"] == 4 * MiB + 4 * KiB
    assert (moved.peak_allocated, moved.peak_reserved) == (plain.peak_allocated, plain.peak_reserved)


def test_context_and_oom() -> None:
    r = estimate(mlp(), torch.empty(B, 1024), gpu="24GiB", context="500MiB")
    assert r.peak_device_used == r.peak_reserved + 500 * MiB and r.fits
    small = estimate(mlp(), torch.empty(B, 1024), gpu="128MiB", context=0)
    # 3 x params + workspaces alone exceed 128 MiB: OOM, and the figures are what the step needs
    assert not small.fits and small.oom is not None
    assert small.oom["message"].startswith("CUDA out of memory.")
    assert small.peak_device_used > 128 * MiB
    assert small.categories["parameters"] == PARAMS


def test_the_default_context_is_the_measured_one() -> None:
    # context.txt (H200, CUDA 13.0): 774,701,056 B used after a first matmul, 56,623,104 B of it
    # reserved by PyTorch: the rest is the context, as `vram estimate`'s --context default
    r = estimate(mlp(), torch.empty(B, 1024), gpu="24GiB", optimizer="sgd")
    assert r.context == 774_701_056 - 56_623_104
    assert r.peak_device_used == r.peak_reserved + 774_701_056 - 56_623_104
    with pytest.raises(ValueError, match="exceed total_memory: 718,077,952 B of CUDA context"):
        estimate(mlp(), torch.empty(B, 1024), gpu="128MiB")


def test_smallest_card_frees_the_cache_as_the_allocator_would() -> None:
    """Two 30 MiB blocks, one freed, then 40 MiB: each request over 10 MiB gets a segment of its
    own size (spec §6) and a 40 MiB request cannot use the cached 30 MiB block, so the run reserves
    100 MiB at its peak; on a 70 MiB card the allocator frees that unused cached segment and retries
    (spec §9), so 70 MiB is the smallest card, and 68 MiB is too small for 30 + 40 live."""
    import vram
    from vram.estimate.engine import smallest_card
    from vram.frontend import memory as m

    vram.simulate(total_memory="1GiB")
    m._record_memory_history("all", context=None)
    a, _ = m.caching_allocator_alloc(30 * MiB), m.caching_allocator_alloc(30 * MiB)
    m.caching_allocator_delete(a)
    m.caching_allocator_alloc(40 * MiB)
    assert m.max_memory_reserved() == 100 * MiB
    snap = m._snapshot()
    assert smallest_card(snap, 0, 0, 1 << 30) == 70 * MiB
    assert smallest_card(snap, 8 * MiB, 0, 1 << 30) == 78 * MiB    # the context comes on top
    assert smallest_card(snap, 0, 0, 68 * MiB) is None


def test_max_batch_is_the_exact_boundary() -> None:
    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 256))

    def make(b: int) -> torch.Tensor:
        return torch.empty(b, 256, device="meta")

    n = 4096
    # a GPU exactly as large as batch n needs (its reserved peak; no CUDA context): n fits by
    # definition, and batch 2n's live tensors alone (allocated, before any cache) are larger than that GPU
    gpu = estimate(model, make(n), optimizer="sgd", context=0).peak_device_used
    assert estimate(model, make(2 * n), optimizer="sgd", context=0).peak_allocated > gpu
    assert fits(model, make(n), gpu=gpu, optimizer="sgd", context=0)
    assert not fits(model, make(2 * n), gpu=gpu, optimizer="sgd", context=0)
    out = io.StringIO()
    best = max_batch(model, make, gpu=gpu, optimizer="sgd", context=0, progress=out)
    assert n <= best < 2 * n
    # guided by each run's room: fewer runs than doubling to 8192 and bisecting down to it (26)
    assert len(out.getvalue().splitlines()) <= 20
    assert fits(model, make(best), gpu=gpu, optimizer="sgd", context=0)
    assert not fits(model, make(best + 1), gpu=gpu, optimizer="sgd", context=0)
    assert max_batch(model, make, gpu=64 * MiB, context=0) == 0  # 2 cuBLAS workspaces: 64 MiB


def test_report_and_json(adam: EstimateResult) -> None:
    text = str(adam)
    for needle in ("vram estimate: Sequential", "forward", "backward", "optimizer step", "parameters",
                   "optimizer state", "activations", "cuBLAS workspaces", "fits"):
        assert needle in text
    from vram.units import format_size

    assert format_size(adam.peak_allocated) in text and format_size(PARAMS) in text
    obj = json.loads(json.dumps(adam.to_json()))
    assert obj["categories"]["parameters"] == PARAMS and obj["peak_allocated"] == adam.peak_allocated


def test_errors() -> None:
    with pytest.raises(ValueError):
        estimate(mlp(), torch.empty(B, 1024), amp="fp8")
    with pytest.raises(ValueError):
        estimate(mlp(), torch.empty(B, 1024), optimizer="lion")
    with pytest.raises(TypeError):
        estimate(lambda: 3, torch.empty(B, 1024))
    with simulated_cuda(), pytest.raises(RuntimeError):
        estimate(mlp(), torch.empty(B, 1024))


def test_leaves_vram_simulate_state_alone() -> None:
    import vram

    vram.simulate("6GiB")
    keep = vram.empty((1024, 1024))
    estimate(mlp(), torch.empty(B, 1024))
    assert vram.memory_allocated() == 4 * MiB and vram.mem_get_info()[1] == 6 * GiB
    del keep


@pytest.fixture
def model_file(tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> str:
    path = os.path.join(os.fspath(tmp_path), "tinymodels.py")
    with open(path, "w") as f:
        f.write(textwrap.dedent("""\
            import torch.nn as nn

            def mlp():
                return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))

            class Two(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.emb = nn.Embedding(1000, 64)
                    self.lin = nn.Linear(64, 64)

                def forward(self, ids, x):
                    return self.emb(ids).sum(1) + self.lin(x)

            class WithLoss(nn.Module):  # returns what a Hugging Face model returns given labels
                def __init__(self):
                    super().__init__()
                    self.lin, self.aux = nn.Linear(64, 2048), nn.Linear(64, 64)

                def forward(self, x, labels):
                    loss = nn.functional.cross_entropy(self.lin(x), labels)
                    return {"loss": loss, "hidden": self.aux(x)}

            def not_a_model():
                return 42
            """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "tinymodels", raising=False)
    yield path
    sys.modules.pop("tinymodels", None)


def test_cli_estimate(model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["estimate", "tinymodels:mlp", "--input", "32x256", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    params = r512(1024 * 256 * 4) + r512(1024 * 4) + r512(256 * 1024 * 4) + r512(256 * 4)
    assert obj["categories"]["parameters"] == params and obj["fits"]
    assert obj["categories"]["optimizer_state"] == 2 * params
    assert cli.main(["estimate", "tinymodels:mlp", "--input", "32x256", "--dtype", "bf16",
                     "--optimizer", "sgd", "--gpu", "24GiB", "--context", "500MiB"]) == 0
    out = capsys.readouterr().out
    assert "vram estimate: Sequential" in out and "24.00 GiB" in out
    assert cli.main(["estimate", "tinymodels:Two", "--input", "4x16:int64", "--input", "4x64", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["inputs"] == ["4x16 int64", "4x64 float32"]
    assert obj["categories"]["parameters"] == r512(1000 * 64 * 4) + r512(64 * 64 * 4) + r512(64 * 4)


def test_cli_named_inputs_and_a_returned_loss(model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--input NAME=SHAPE`` calls forward with keywords; a ``loss`` the model returns (Hugging
    Face with labels) is what backward runs from, not the sum of every output."""
    assert cli.main(["estimate", "tinymodels:Two", "--input", "x=4x64", "--input", "ids=4x16:int64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"] == ["x=4x64 float32", "ids=4x16 int64"]
    assert cli.main(["estimate", "tinymodels:WithLoss", "--input", "x=32x64", "--input", "labels=32:int64",
                     "--json"]) == 0
    # Adam makes state only for parameters that got a gradient: `aux` is outside the loss
    lin = r512(2048 * 64 * 4) + r512(2048 * 4)
    assert json.loads(capsys.readouterr().out)["categories"]["optimizer_state"] == 2 * lin


def test_cli_max_batch(model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["estimate", "tinymodels:mlp", "--input", "8x256", "--gpu", "200MiB", "--context", "0",
                     "--optimizer", "sgd", "--max-batch", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    best = obj["max_batch"]
    assert best > 8 and obj["estimate"]["fits"] and obj["estimate"]["inputs"] == [f"{best}x256 float32"]
    model = lambda: nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))  # noqa: E731
    assert not fits(model, torch.empty(best + 1, 256), gpu="200MiB", context=0, optimizer="sgd")


@pytest.mark.parametrize("argv, message", [
    (["tinymodels:missing", "--input", "8x256"], "has no attribute"),
    (["nosuchmodule:mlp", "--input", "8x256"], "cannot import"),
    (["tinymodels:not_a_model", "--input", "8x256"], "not an nn.Module"),
    (["tinymodels:mlp", "--input", "8xq"], "invalid --input"),
    (["tinymodels:mlp", "--input", "8x256:float8"], "unknown dtype"),
    (["tinymodels:mlp", "--input", "8x100"], "RuntimeError"),          # a shape mismatch in forward
    (["tinymodels:mlp"], "--input"),
    (["tinymodels:Two", "--input", "ids=4x16:int64", "--input", "4x64"], "name every input"),
    (["tinymodels:Two", "--input", "2d=4x16"], "not an argument name"),
    (["tinymodels", "--input", "8x256"], "MODULE:FACTORY"),
])
def test_cli_errors_are_one_line(model_file: str, capsys: pytest.CaptureFixture[str],
                                 argv: list[str], message: str) -> None:
    assert cli.main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vram: error: ") and message in err and err.count("\n") == 1


def test_cli_help_has_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--help"])
    out = capsys.readouterr().out
    assert "--max-batch" in out and "vram estimate mymodels:gpt2_small --input 8x512:int64" in out


def test_gpu_preset_and_arch(model_file: str, capsys: pytest.CaptureFixture[str]) -> None:
    # A card sets CUDA's total memory, its name and compute capability (vram.devices.gpus, docs/gpus.md);
    # below sm90 each cuBLAS workspace is 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B (pytorch#95668).
    cublas_sm80 = 4096 * 1024 * 2 + 16 * 1024 * 8
    r = estimate(mlp(), torch.empty(B, 1024), gpu="A100-80GB")
    assert r.gpu == 85_100_068_864
    assert r.categories["cublas_workspaces"] == 2 * cublas_sm80 + CUBLASLT
    assert "GPU NVIDIA A100-SXM4-80GB, 79.26 GiB, sm_80" in str(r)
    h = estimate(mlp(), torch.empty(B, 1024), gpu="A100-80GB", arch="9.0")
    assert h.categories["cublas_workspaces"] == WORKSPACES
    assert cli.main(["estimate", "tinymodels:mlp", "--input", "32x256", "--gpu", "T4", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["gpu"] == 15_828_320_256 and obj["settings"]["gpu_name"] == "Tesla T4"
    assert obj["categories"]["cublas_workspaces"] == 2 * cublas_sm80 + CUBLASLT
    assert cli.main(["estimate", "tinymodels:mlp", "--input", "32x256", "--arch", "8.6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["categories"]["cublas_workspaces"] == 2 * cublas_sm80 + CUBLASLT
    assert cli.main(["estimate", "tinymodels:mlp", "--input", "32x256", "--gpu", "A10G"]) == 2
    assert "GPU name" in capsys.readouterr().err


def test_readme_example_models_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's ``cd examples; vram estimate mymodels:...`` commands (smaller inputs)."""
    from vram.cli import main

    examples = Path(__file__).resolve().parents[1] / "examples"
    monkeypatch.chdir(examples)
    monkeypatch.syspath_prepend(str(examples))
    assert main(["estimate", "mymodels:gpt2_small", "--input", "1x32:int64", "--optimizer", "adamw",
                 "--gpu", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "GPT, 124,439,808 parameters" in out  # GPT-2 small with its tied embedding, counted once
    assert main(["estimate", "mymodels:Net", "--input", "2x3x64x64", "--gpu", "24GiB"]) == 0
    assert "Net, 11,689,512 parameters" in capsys.readouterr().out  # ResNet-18's published count


def test_max_batch_search_reports_each_run() -> None:
    """Doubling to the first failure, then bisection; with a progress stream, one line per run
    (its batch and whether it fits) as it ends."""
    from vram.estimate.search import search_largest

    out = io.StringIO()
    assert search_largest(lambda b: b <= 37, progress=out) == 37
    probes = [(int(m[1]), m[2] == "fits") for m in re.finditer(r"batch (\d+) (fits|does not fit)", out.getvalue())]
    assert probes == [(1, True), (2, True), (4, True), (8, True), (16, True), (32, True), (64, False),
                      (48, False), (40, False), (36, True), (38, False), (37, True)]
    assert len(out.getvalue().splitlines()) == len(probes)


def test_a_guided_search_finds_the_same_boundary_in_fewer_runs() -> None:
    """Rooms only choose which batches run: on a staircase memory curve (a fixed part, then 20 MiB
    segments as the batch grows, as the large pool rounds) the answer is the brute-force boundary
    for every card size, in at most `GUESSES` runs more than doubling and bisection, and in all a
    third fewer."""
    from vram.estimate.search import GUESSES, Probe, search_largest

    seg = 20 * MiB

    def reserved(b: int) -> int:
        return 700 * MiB + -(-b * 3_300_000 // seg) * seg

    guided_runs = plain_runs = 0
    for card in range(800 * MiB, 40_000 * MiB, 977 * MiB):
        truth = max((b for b in range(1 << 14) if reserved(b) <= card), default=0)
        runs: list[int] = []

        def probe(b: int, card: int = card, runs: list[int] = runs) -> Probe:
            runs.append(b)
            return Probe(True, card - reserved(b)) if reserved(b) <= card else Probe(False)

        assert search_largest(probe) == truth
        guided = len(runs)
        runs.clear()
        assert search_largest(lambda b: bool(probe(b))) == truth
        assert guided <= len(runs) + GUESSES
        guided_runs, plain_runs = guided_runs + guided, plain_runs + len(runs)
    assert guided_runs * 3 < plain_runs * 2
