"""Classic public write-ups about PyTorch GPU memory, re-run on vram's simulated GPU.

Each test re-runs an experiment whose code and printed numbers were published (forum threads,
GitHub issues, tutorials, books), unmodified except where a comment says why, under
`vram.run.runtime.simulated_cuda` with the article's GPU where it is known, and asserts the numbers
the article printed, exactly, in the article's own format.

Old PyTorch releases differ from torch 2.13 in two allocator-visible ways, which the tests
reproduce with the environment variables PyTorch itself reads (both modelled by
`vram.run.kernels.plan`):

* **torch ≤ 1.13**: cuBLAS allocated its workspace itself (cudaMalloc inside cuBLAS), so
  ``memory_allocated()`` never showed it. From 2.0 on, PyTorch hands cuBLAS a workspace from the
  caching allocator (``CublasHandlePool.cpp``), kept for the life of the process: 8,519,680 B
  (``:4096:2:16:8``) per thread, 32 MiB on sm90. pytorch/pytorch#95668 is the report of exactly that
  change ("1.13 does not have this issue"). ``CUBLAS_WORKSPACE_CONFIG=:0:0`` makes the workspace
  0 bytes, i.e. invisible to the allocator, as before 2.0.
* **torch ≤ 2.4**: each cuBLASLt ``addmm`` allocated its 1 MiB workspace and freed it on return;
  newer releases keep one per (thread, stream). ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes Lt
  share the cuBLAS workspace, which has the same effect on what these articles print (the
  transient 1 MiB never coincides with their peak; see the test).

Everything an article printed is asserted.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from vram.run.runtime import simulated_cuda  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
WS_SM80 = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B: the cuBLAS workspace below sm90
WS_SM90 = 4096 * 8 * 1024                  # 32 MiB on sm90

# Devices named by the articles: (name, major, minor, SMs, total memory)
A10G = dict(name="NVIDIA A10G", major=8, minor=6, multi_processor_count=80, gpu="24GiB")
A100_40 = dict(name="NVIDIA A100-SXM4-40GB", major=8, minor=0, multi_processor_count=108, gpu="40GiB")
A100_80 = dict(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, multi_processor_count=108, gpu="80GiB")
V100_16 = dict(name="Tesla V100-SXM2-16GB", major=7, minor=0, multi_processor_count=80, gpu=16160 * MiB)
H100 = dict(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132, gpu="80GiB")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
                "CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def torch_1_13(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PyTorch ≤ 1.13: cuBLAS's workspace did not come from the caching allocator."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    yield


@pytest.fixture
def torch_2_4(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PyTorch 2.0–2.4: persistent cuBLAS workspaces, but no persistent cuBLASLt workspace."""
    monkeypatch.setenv("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1")
    yield


# ------------------------------------------------------------------------------------------------
# 1. https://github.com/pytorch/pytorch/issues/95668 ("Nightly is leaking memory with a simple
#    Linear layer", torch 2.0.0.dev20230227+cu118, GPU 0: NVIDIA A10G = sm86). The reporter's
#    assertion fails with ``AssertionError: (8519680, 0)``: memory_allocated() is 8519680 after a
#    function whose tensors are all gone, 0 before. It is the first matmul's cuBLAS workspace,
#    allocated through the caching allocator since 2.0 and kept.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu, expected", [(A10G, 8519680), (H100, WS_SM90)], ids=["A10G-sm86", "H100-sm90"])
def test_issue_95668_linear_leaves_the_cublas_workspace(gpu: dict, expected: int) -> None:
    with simulated_cuda(**gpu):
        device = torch.device("cuda")
        start_cuda_memory = torch.cuda.memory_allocated(device)

        def f() -> None:
            model = torch.nn.Linear(1, 1, device=device)
            b = torch.randn(1, 1, device=device)
            model(b)

        f()
        torch.cuda.synchronize(device)
        cuda_memory = torch.cuda.memory_allocated(device)
        # the article (A10G): AssertionError: (8519680, 0); an H100 keeps 32 MiB instead
        assert (cuda_memory, start_cuda_memory) == (expected, 0)


# ------------------------------------------------------------------------------------------------
# 2. https://github.com/pytorch/pytorch/issues/74443 ("cuda memory allocated doesn't match what I
#    have declared", 2022-03, torch 1.11): two bias-free Linear(1024, 1024), input (4, 256, 1024):
#    "running result is what I expected: `memory1: 16777728 memory2: 20972032`" (parameters +
#    input + activation + the 512-byte sum; then + gradients - activation).
# ------------------------------------------------------------------------------------------------
def _issue_74443(rows: int) -> tuple[int, int]:
    model = nn.Sequential(nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False)).cuda()
    x = torch.rand(4, rows, 1024).cuda()
    y = model(x).sum()
    memory1 = torch.cuda.memory_allocated()
    y.backward()
    memory2 = torch.cuda.memory_allocated()
    return memory1, memory2


def test_issue_74443_parameters_activations_gradients(torch_1_13: None) -> None:
    with simulated_cuda(**A100_40):
        assert _issue_74443(256) == (16777728, 20972032)


def test_issue_74443_same_script_on_torch_2() -> None:
    # From 2.0 on, the forward's first matmul adds the main thread's workspace and the backward's
    # the autograd thread's: the same script prints 16777728 + 1 and 20972032 + 2 workspaces.
    with simulated_cuda(**A100_40):
        assert _issue_74443(256) == (16777728 + WS_SM80, 20972032 + 2 * WS_SM80)


# ------------------------------------------------------------------------------------------------
# 3. https://discuss.pytorch.org/t/memory-inefficient-in-batch-matrix-multiplication-with-autograd/28164
#    (2018, torch 0.4): x = FloatTensor(8192, 512).requires_grad_().cuda();
#    strategy 1, x.view(8192, 8, 1, 64) @ W1 (8, 64, 64): ``print(torch.cuda.memory_allocated()) #
#    1107427328``; strategy 2, x.view(8192, 1, 512) @ W2 (512, 512): ``# 34603008``. matmul expands
#    W1 to (8192, 8, 64, 64) and materialises it (1 GiB) for bmm, which saves it for backward.
# ------------------------------------------------------------------------------------------------
def test_discuss_28164_batched_matmul(torch_1_13: None) -> None:
    with simulated_cuda(**A100_40):
        x = torch.FloatTensor(8192, 512).requires_grad_().cuda()
        x1 = x.view(8192, 8, 1, 64)  # 512 = 8 * 64
        W1 = torch.FloatTensor(8, 64, 64).cuda()
        out1 = torch.matmul(x1, W1)  # out: [8192, 8, 1, 64]
        assert torch.cuda.memory_allocated() == 1107427328
    with simulated_cuda(**A100_40):
        x = torch.FloatTensor(8192, 512).requires_grad_().cuda()
        x2 = x.view(8192, 1, 512)  # add one dimension for batch matmul
        W2 = torch.FloatTensor(512, 512).cuda()  # larger than W1
        out2 = torch.matmul(x2, W2)
        assert torch.cuda.memory_allocated() == 34603008
    del out1, out2


# ------------------------------------------------------------------------------------------------
# 4. https://github.com/pytorch/pytorch/issues/69526, also
#    https://discuss.pytorch.org/t/why-the-reserved-memory-space-generated-by-the-forwarding-of-net-cant-be-released/138814
#    (2021-12): Conv2d(3, 28, 3) + two MaxPool2d(3, 2, 1) under no_grad on 512×3×224×224, printed
#    in MB (= MiB, truncated):
#      before forward 1st | memory_reserved: 296MB | memory allocated: 294MB
#      after forward 1st epoch | memory_reserved: 5014MB | memory allocated: 465MB
#      after forward 2nd epoch | memory_reserved: 5688MB | memory allocated: 465MB
#      after empty_cache 1st epoch | memory_reserved: 1644MB | memory allocated: 465MB
#    Every figure follows from best fit + splitting: the output of the last max-pool (171.5 MiB)
#    lands in the freed 1348 MiB segment of the first max-pool's int64 indices (CUDA's max_pool2d
#    always computes indices), which empty_cache() then cannot release: 294 + 2 + 1348 = 1644.
#    No cuBLAS call is made, so the GPU's architecture does not matter.
# ------------------------------------------------------------------------------------------------
class _Net69526(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 28, (3, 3))  # in out kernel size
        self.maxpool1 = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.maxpool2 = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        x = self.maxpool1(x)
        x = self.maxpool2(x)
        return x


def test_issue_69526_reserved_memory_that_empty_cache_cannot_release() -> None:
    seen = []
    with simulated_cuda(**A100_40):
        net = _Net69526().to('cuda')
        for i in range(2):
            with torch.no_grad():
                frames_batches = torch.randn(512, 3, 224, 224).to('cuda')
                before = (torch.cuda.memory_reserved() // MiB, torch.cuda.memory_allocated() // MiB)
                pred = net(frames_batches)
                after = (torch.cuda.memory_reserved() // MiB, torch.cuda.memory_allocated() // MiB)
                torch.cuda.empty_cache()
                emptied = (torch.cuda.memory_reserved() // MiB, torch.cuda.memory_allocated() // MiB)
                seen.append((before, after, emptied))
        del pred
    assert seen[0] == ((296, 294), (5014, 465), (1644, 465))
    assert seen[1][1] == (5688, 465)


# ------------------------------------------------------------------------------------------------
# 5. https://discuss.pytorch.org/t/why-doesn-t-my-tensor-offloading-strategy-reduce-gpu-memory-usage-in-forward-pass/208243
#    (2024-08): 40 × Linear(4096, 4096) + ReLU, printed with two decimals in MB (MiB):
#      Testing without offloading:
#      Memory allocated before forward pass: 2576.62 MB
#      Memory allocated after forward pass: 3224.75 MB
#      Max memory allocated during forward pass: 3240.75 MB
#      Testing with offloading:
#      Memory allocated before forward pass: 2584.75 MB
#      Memory allocated after forward pass: 3224.75 MB
#      Max memory allocated during forward pass: 3240.75 MB
#    2576.62 = 40 × (64 MiB + 16 KiB) parameters + a 16 MiB input (so (1024, 4096) float32);
#    +648.125 = 40 saved ReLU outputs + the 8.125 MiB (8,519,680 B) cuBLAS workspace — so not an
#    sm90 GPU, and no persistent cuBLASLt workspace (torch ≤ 2.4); the second run starts 8.125 MiB
#    higher because the workspace stays. The thread shows only the offloading branch of forward();
#    the plain branch is the same loop without ``prev_tensor.to('cpu', non_blocking=True)``. The
#    second run here is that plain loop too: the offloaded copy is host memory whose result is
#    discarded (and vram refuses device-to-host copies, which need values), so on the GPU side
#    the two runs allocate the same, as the article's identical "after" figures show.
# ------------------------------------------------------------------------------------------------
class _DeepModel(nn.Module):
    def __init__(self, layer_num: int = 40, layer_size: int = 4096) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(layer_size, layer_size) for _ in range(layer_num)])
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev_tensor = x
        for idx, layer in enumerate(self.layers):
            x = self.relu(layer(prev_tensor))
            prev_tensor = x
        return x


def _offload_runs(gpu: dict) -> list[str]:
    lines = []
    with simulated_cuda(**gpu):
        for _ in range(2):
            model = _DeepModel().cuda()
            x = torch.randn(1024, 4096, device="cuda")
            torch.cuda.reset_peak_memory_stats()
            lines.append(f"Memory allocated before forward pass: {torch.cuda.memory_allocated() / 1024**2:.2f} MB")
            out = model(x)
            lines.append(f"Memory allocated after forward pass: {torch.cuda.memory_allocated() / 1024**2:.2f} MB")
            lines.append(f"Max memory allocated during forward pass: {torch.cuda.max_memory_allocated() / 1024**2:.2f} MB")
            del model, x, out
    return lines


def test_discuss_208243_forward_activations_and_workspace(torch_2_4: None) -> None:
    assert _offload_runs(A100_80) == [
        "Memory allocated before forward pass: 2576.62 MB",
        "Memory allocated after forward pass: 3224.75 MB",
        "Max memory allocated during forward pass: 3240.75 MB",
        "Memory allocated before forward pass: 2584.75 MB",
        "Memory allocated after forward pass: 3224.75 MB",
        "Max memory allocated during forward pass: 3240.75 MB",
    ]


# ------------------------------------------------------------------------------------------------
# 6. https://github.com/tamera-lanham/mlab/blob/main/days/w3d1/gradient-sandbox.ipynb (2022,
#    torch 1.x): an MLP 16-32-1024-2^20-1024-32-16 without biases on a 1-D input, printed as
#    ``f'{gpu} memory usage: {mem(gpu):.2f} GiB'``: 0.00 (inputs), 8.00 (two 4 GiB weights),
#    8.00 (forward), 8.00 (loss), 16.00 (gradients); after ``del`` everything: 0.00.
#    On torch ≥ 2.0 the same notebook prints 8.01 / 16.02 / 0.02: two cuBLAS workspaces.
# ------------------------------------------------------------------------------------------------
class _MLP(nn.Module):
    def __init__(self, layer_sizes: list[int] = [16, 128, 128, 16], bias: bool = False, device: object = None) -> None:
        super().__init__()
        self.model = nn.Sequential(
            *[nn.Linear(size, layer_sizes[i + 1], bias, device) for i, size in enumerate(layer_sizes[:-1])]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _mlab_notebook() -> list[str]:
    t = torch
    out = []
    mem = lambda gpu: t.cuda.memory_allocated(gpu) / 2**(30)  # noqa: E731
    mems = lambda gpu: f'{gpu} memory usage: {mem(gpu):.2f} GiB'  # noqa: E731
    with simulated_cuda(**A100_40):
        layer_sizes = [16, 2**5, 2**10, 2**20, 2**10, 2**5, 16]
        gpu = 'cuda:0'
        X = t.randn((layer_sizes[0],), device=gpu)
        y = t.randn((layer_sizes[-1],), device=gpu)
        out.append(f"1 {mems(gpu)}")
        mlp = _MLP(layer_sizes, device=gpu)
        out.append(f"2 {mems(gpu)}")
        y_pred = mlp(X)
        out.append(f"3 {mems(gpu)}")
        loss_fn = nn.MSELoss()
        loss = loss_fn(y, y_pred)
        out.append(f"4 {mems(gpu)}")
        loss.backward()  # creates p.grad for p in mlp.parameters()
        out.append(f"5 {mems(gpu)}")
        del X, y, mlp, y_pred, loss_fn, loss
        out.append(mems(gpu))
    return out


def test_mlab_gradient_sandbox(torch_1_13: None) -> None:
    assert _mlab_notebook() == [
        "1 cuda:0 memory usage: 0.00 GiB",
        "2 cuda:0 memory usage: 8.00 GiB",
        "3 cuda:0 memory usage: 8.00 GiB",
        "4 cuda:0 memory usage: 8.00 GiB",
        "5 cuda:0 memory usage: 16.00 GiB",
        "cuda:0 memory usage: 0.00 GiB",
    ]


def test_mlab_gradient_sandbox_on_torch_2() -> None:
    printed = _mlab_notebook()
    assert [printed[2], printed[4], printed[5]] == [
        "3 cuda:0 memory usage: 8.01 GiB", "5 cuda:0 memory usage: 16.02 GiB", "cuda:0 memory usage: 0.02 GiB"]


# ------------------------------------------------------------------------------------------------
# 7. Sebastian Raschka, "Build a Large Language Model From Scratch", bonus notebook
#    https://github.com/rasbt/LLMs-from-scratch/blob/main/ch05/08_memory_efficient_weight_loading/memory-efficient-state-dict.ipynb
#    (torch 2.4.1+cu121, GPT-2 XL 1558M, ``max_memory_allocated() / 1024**3`` with one decimal):
#      model.to(device)                               -> "Maximum GPU memory allocated: 6.4 GB"
#      + load_state_dict(torch.load(..., map_location=device)) -> "... 12.8 GB"
#      sequential: model.to(device); then per parameter param.copy_(state_dict[name].to(device))
#                                                     -> "... 6.4 GB", "... 6.7 GB"
#    The tensors total 6.29 GiB (1,638,022,400 float32 parameters + 48 causal masks of 4 MiB); 6.4
#    comes from the allocator, which counts blocks, not requests, and splits a large block only
#    when more than 1 MiB would remain: each 39.06 MiB feed-forward weight gets a 40 MiB segment
#    (0.94 MiB unsplit), and every second 9.77 MiB attention weight takes the 10.23 MiB left in a
#    20 MiB segment (0.47 MiB unsplit) — 135 MiB in all. 6.7 = 6.4 + the largest parameter (the
#    321.6 MB token embedding) in transit. The model classes below restate the book's
#    ``previous_chapters.py`` (ch05/08) for what allocates memory; forward() is not run here.
# ------------------------------------------------------------------------------------------------
class _MultiHeadAttention(nn.Module):
    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 qkv_bias: bool = False) -> None:
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer('mask', torch.triu(torch.ones(context_length, context_length), diagonal=1))


class _LayerNorm(nn.Module):
    def __init__(self, emb_dim: int) -> None:
        super().__init__()
        self.eps = 1e-5
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))


class _FeedForward(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(cfg["emb_dim"], 4 * cfg["emb_dim"]), nn.GELU(),
                                    nn.Linear(4 * cfg["emb_dim"], cfg["emb_dim"]))


class _TransformerBlock(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.att = _MultiHeadAttention(d_in=cfg["emb_dim"], d_out=cfg["emb_dim"],
                                       context_length=cfg["context_length"], num_heads=cfg["n_heads"],
                                       dropout=cfg["drop_rate"], qkv_bias=cfg["qkv_bias"])
        self.ff = _FeedForward(cfg)
        self.norm1 = _LayerNorm(cfg["emb_dim"])
        self.norm2 = _LayerNorm(cfg["emb_dim"])
        self.drop_shortcut = nn.Dropout(cfg["drop_rate"])


class _GPTModel(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"])
        self.pos_emb = nn.Embedding(cfg["context_length"], cfg["emb_dim"])
        self.drop_emb = nn.Dropout(cfg["drop_rate"])
        self.trf_blocks = nn.Sequential(*[_TransformerBlock(cfg) for _ in range(cfg["n_layers"])])
        self.final_norm = _LayerNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False)


GPT2_XL = {"vocab_size": 50257, "context_length": 1024, "drop_rate": 0.0, "qkv_bias": True,
           "emb_dim": 1600, "n_layers": 48, "n_heads": 25}


def _max_gb() -> str:
    return f"Maximum GPU memory allocated: {torch.cuda.max_memory_allocated() / (1024 ** 3):.1f} GB"


@pytest.fixture(scope="module")
def gpt2_xl_checkpoint() -> Iterator[str]:
    """A model.pth with GPT-2 XL's state-dict layout; ``skip_data`` leaves the 6.5 GB of values
    out (a sparse file): no experiment here reads them."""
    with torch.device("meta"):
        shapes = {k: (v.shape, v.dtype) for k, v in _GPTModel(GPT2_XL).state_dict().items()}
    state = {k: torch.empty(s, dtype=d) for k, (s, d) in shapes.items()}  # untouched host pages
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.pth")
        with torch.serialization.skip_data():
            torch.save(state, path)
        del state
        yield path


@pytest.mark.slow
def test_raschka_sequential_weight_loading(gpt2_xl_checkpoint: str) -> None:
    printed = []
    with simulated_cuda(**A100_80):
        device = torch.device("cuda")
        torch.cuda.reset_peak_memory_stats()  # start_memory_tracking()
        model = _GPTModel(GPT2_XL).to(device)
        with torch.serialization.skip_data():  # the notebook reads real values; none are needed
            state_dict = torch.load(gpt2_xl_checkpoint, map_location="cpu", weights_only=True)
        printed.append(_max_gb())
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in state_dict:
                    param.copy_(state_dict[name].to(device))
        printed.append(_max_gb())
    assert printed == ["Maximum GPU memory allocated: 6.4 GB", "Maximum GPU memory allocated: 6.7 GB"]
    # the tensors alone (parameters and the masks, all in the state dict) would print 6.3
    assert f"{sum(t.nbytes for t in state_dict.values()) / 1024**3:.1f}" == "6.3"


@pytest.mark.slow
def test_raschka_load_state_dict_to_device(gpt2_xl_checkpoint: str) -> None:
    with simulated_cuda(**A100_80):
        device = torch.device("cuda")
        torch.cuda.reset_peak_memory_stats()
        model = _GPTModel(GPT2_XL)
        model.to(device)
        with torch.serialization.skip_data():  # the notebook reads real values; none are needed
            state_dict = torch.load(gpt2_xl_checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state_dict)
        model.to(device)
        model.eval()
        assert _max_gb() == "Maximum GPU memory allocated: 12.8 GB"


# ------------------------------------------------------------------------------------------------
# 8. Hugging Face Transformers docs, "Model training anatomy"
#    https://huggingface.co/docs/transformers/model_memory_anatomy (source:
#    huggingface/transformers docs/source/en/model_memory_anatomy.md), a Tesla V100-SXM2 with
#    16160 MiB, NVML's "used" memory printed as ``info.used//1024**2``:
#      torch.ones((1, 1)).to("cuda")                        -> "GPU memory occupied: 1343 MB."
#      AutoModelForSequenceClassification.from_pretrained("google-bert/bert-large-uncased").to("cuda")
#                                                           -> "GPU memory occupied: 2631 MB."
#    NVML's "used" is what mem_get_info() leaves out: the CUDA context plus PyTorch's reserved
#    segments. The first figure fixes the context: 1343 MiB − the 2 MiB small segment of the 1×1
#    tensor = 1341 MiB. The second is then predicted: bert-large's 335,143,938 float32 parameters
#    (1279.3 MiB) plus its two int64 buffers reserve 1290 MiB of segments (126 MiB word embedding,
#    48 × 16 MiB feed-forward weights, 20 MiB segments of 4 MiB attention weights, 2 MiB small
#    segments), and 1341 + 1290 = 2631. transformers is not installed here: the classes below
#    restate modeling_bert.py's parameter and buffer layout (values do not matter; ``.to()`` moves
#    children first, in registration order, as PyTorch's Module._apply does).
# ------------------------------------------------------------------------------------------------
class _BertEmbeddings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(30522, 1024, padding_idx=0)
        self.position_embeddings = nn.Embedding(512, 1024)
        self.token_type_embeddings = nn.Embedding(2, 1024)
        self.LayerNorm = nn.LayerNorm(1024, eps=1e-12)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("position_ids", torch.arange(512).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros((1, 512), dtype=torch.long), persistent=False)


class _BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        self.attention.self.query = nn.Linear(1024, 1024)
        self.attention.self.key = nn.Linear(1024, 1024)
        self.attention.self.value = nn.Linear(1024, 1024)
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(1024, 1024)
        self.attention.output.LayerNorm = nn.LayerNorm(1024, eps=1e-12)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(1024, 4096)
        self.output = nn.Module()
        self.output.dense = nn.Linear(4096, 1024)
        self.output.LayerNorm = nn.LayerNorm(1024, eps=1e-12)


class _BertForSequenceClassification(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bert = nn.Module()
        self.bert.embeddings = _BertEmbeddings()
        self.bert.encoder = nn.Module()
        self.bert.encoder.layer = nn.ModuleList(_BertLayer() for _ in range(24))
        self.bert.pooler = nn.Module()
        self.bert.pooler.dense = nn.Linear(1024, 1024)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(1024, 2)


def test_hf_model_memory_anatomy_bert_large_on_v100() -> None:
    def print_gpu_utilization() -> str:  # NVML's used memory = total - free
        free, total = torch.cuda.mem_get_info()
        return f"GPU memory occupied: {(total - free) // 1024**2} MB."

    with simulated_cuda(context=1341 * MiB, **V100_16):
        printed = []
        _ = torch.ones((1, 1)).to("cuda")  # the REPL keeps the result in ``_``
        printed.append(print_gpu_utilization())
        model = _BertForSequenceClassification().to("cuda")
        printed.append(print_gpu_utilization())
        assert sum(p.numel() for p in model.parameters()) == 335_143_938
    assert printed == ["GPU memory occupied: 1343 MB.", "GPU memory occupied: 2631 MB."]


# ------------------------------------------------------------------------------------------------
# 9. torchtune docs, "Fine-Tuning Llama2 with QLoRA"
#    https://docs.pytorch.org/torchtune/stable/tutorials/qlora_finetune.html (source:
#    pytorch/torchtune docs/source/tutorials/qlora_finetune.rst):
#      torch.set_default_device("cuda")
#      qlora_linear = LoRALinear(512, 512, rank=8, alpha=0.1, quantize_base=True)
#      print(torch.cuda.memory_allocated())  # 177,152 bytes
#      del qlora_linear
#      torch.cuda.empty_cache()
#      lora_linear = LoRALinear(512, 512, rank=8, alpha=0.1, quantize_base=False)
#      print(torch.cuda.memory_allocated()) # 1,081,344 bytes
#    The quantized half needs torchao's NF4 tensor subclass (not installed), so only the
#    unquantized line is reproduced; the class below restates torchtune's LoRALinear for the
#    quantize_base=False path (a bias-free nn.Linear's weight, lora_a, lora_b, in-place init).
# ------------------------------------------------------------------------------------------------
class _LoRALinear(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float, dropout: float = 0.0,
                 use_bias: bool = False, quantize_base: bool = False) -> None:
        super().__init__()
        assert not quantize_base
        self.in_dim, self.out_dim, self.rank, self.alpha, self.use_bias = in_dim, out_dim, rank, alpha, use_bias
        linear = nn.Linear(in_features=in_dim, out_features=out_dim, bias=use_bias)
        self.register_parameter("weight", nn.Parameter(linear.weight))
        self.register_parameter("bias", nn.Parameter(linear.bias) if use_bias else None)
        self.dropout = nn.Dropout(p=dropout) if dropout > 0.0 else nn.Identity()
        self.lora_a = nn.Linear(in_features=in_dim, out_features=rank, bias=False)
        self.lora_b = nn.Linear(in_features=rank, out_features=out_dim, bias=False)
        self.merged = False
        nn.init.kaiming_uniform_(self.lora_a.weight, a=5 ** 0.5)
        nn.init.zeros_(self.lora_b.weight)


def test_torchtune_qlora_tutorial_lora_linear() -> None:
    with simulated_cuda(**A100_80):
        torch.set_default_device("cuda")
        try:
            lora_linear = _LoRALinear(512, 512, rank=8, alpha=0.1, quantize_base=False)
            assert torch.cuda.memory_allocated() == 1_081_344
        finally:
            torch.set_default_device(None)
        del lora_linear
