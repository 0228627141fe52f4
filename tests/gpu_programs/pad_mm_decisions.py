"""What Inductor's pad_mm decides on this GPU, and from which figures: one JSON line per fact,
prefixed ``PADMM``, for a table of measured decisions.

First the card's figures as Inductor's cost model reads them (torch/_inductor/utils.py
``get_device_tflops`` per dtype, with and without TF32, ``get_gpu_dram_gbps``,
``get_gpu_shared_memory``; Triton's driver properties; ``nvidia-smi``'s max clocks;
``torch._utils_internal.max_clock_rate``; the datasheet table's answer), then, for a grid of
matmuls (mm, addmm, bmm; fp16, bf16, fp32 with and without TF32), each compiled on its own with an
empty Inductor cache: ``is_mm_compute_bound``, every ``_should_pad`` answer, the benchmark's two
times where it ran (``is_padded_faster``), the ``pad_mm_bench`` counter and the sizes of the
buffers the compiled wrapper allocated (``torch.cuda.memory`` history), then the same grid under
``torch._inductor.config.deterministic`` (the learned AutoHeuristic decides). Under ``vram run``
the figures are the simulated card's where the script process can read them, and the decisions
are made in the compile process (not seen here): the run goes to its end.
"""
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="padmm_inductor_"))  # a first run

import torch  # noqa: E402


def say(kind, **fields):
    print("PADMM", json.dumps({"kind": kind, **fields}, default=str), flush=True)


def attempt(fn):
    try:
        return fn()
    except Exception as e:  # a figure this machine cannot give: named
        return f"{type(e).__name__}: {e}"


def card_figures():
    from torch._inductor import utils

    def tflops(dtype, precision):
        saved = torch.backends.cuda.matmul.fp32_precision
        torch.backends.cuda.matmul.fp32_precision = precision
        try:
            utils.get_device_tflops.cache_clear() if hasattr(utils.get_device_tflops, "cache_clear") else None
            return attempt(lambda: utils.get_device_tflops(dtype))
        finally:
            torch.backends.cuda.matmul.fp32_precision = saved

    def triton_props():
        from triton.runtime import driver
        return driver.active.utils.get_device_properties(0)

    def smi():
        out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=name,clocks.max.sm,clocks.max.memory,"
                              "clocks.sm,clocks.mem,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=False)
        return out.stdout.strip() or out.stderr.strip()

    def datasheet():
        from torch._inductor.analysis.device_info import datasheet_tops
        return {str(d): datasheet_tops(d) for d in (torch.float16, torch.bfloat16, torch.float32)}

    def max_clock():
        from torch._utils_internal import max_clock_rate
        return max_clock_rate()

    props = torch.cuda.get_device_properties(0)
    say("card", torch=torch.__version__, cuda=torch.version.cuda, name=props.name,
        capability=[props.major, props.minor], sms=props.multi_processor_count,
        l2=getattr(props, "L2_cache_size", None), total_memory=props.total_memory,
        triton=attempt(lambda: __import__("triton").__version__), triton_props=attempt(triton_props),
        nvidia_smi=attempt(smi), max_clock_rate=attempt(max_clock), datasheet=attempt(datasheet),
        tflops={f"{d}/{p}": tflops(d, p) for d in (torch.float16, torch.bfloat16, torch.float32)
                for p in ("ieee", "tf32")},
        dram_gbps=attempt(utils.get_gpu_dram_gbps), shared=attempt(utils.get_gpu_shared_memory))


DECISIONS = []


def watch_pad_mm():
    """Record every ``_should_pad`` answer and every benchmark (in this process: on a GPU)."""
    from torch._inductor.fx_passes import pad_mm

    should, faster = pad_mm._should_pad, pad_mm.is_padded_faster

    def should_pad(match, mat1, mat2, op, input=None):
        answer = should(match, mat1, mat2, op, input)
        shape = [list(map(int, mat1.shape)), list(map(int, mat2.shape))]
        m, k, n = int(mat1.shape[-2]), int(mat1.shape[-1]), int(mat2.shape[-1])
        DECISIONS.append({"op": str(op), "shapes": shape, "strides": [list(mat1.stride()), list(mat2.stride())],
                          "dtype": str(mat1.dtype), "pad": bool(answer),
                          "compute_bound": attempt(lambda: pad_mm.is_mm_compute_bound(m, k, n, mat1.dtype))})
        return answer

    def is_padded_faster(key, ori_time, pad_time):
        answer = faster(key, ori_time, pad_time)
        DECISIONS.append({"bench": key, "ori_time": ori_time, "pad_time": pad_time, "pad": bool(answer)})
        return answer

    pad_mm._should_pad, pad_mm.is_padded_faster = should_pad, is_padded_faster


GRID = [  # (name, kind, m, k, n, batch, bias)
    ("small_n", "mm", 64, 1000, 1001, 0, False),
    ("fp32_n", "mm", 256, 256, 257, 0, False),
    ("square", "mm", 2048, 2048, 2049, 0, False),
    ("ah_a100_pad", "mm", 8192, 8191, 2048, 0, False),
    ("gpt2_head", "mm", 8192, 768, 50257, 0, False),
    ("gpt2_head_grad", "mm", 8192, 50257, 768, 0, False),
    ("bert_head", "addmm", 4096, 768, 30522, 0, True),
    ("vit_attn", "bmm", 197, 64, 197, 12, False),
]


def one(name, kind, m, k, n, batch, bias, dtype, precision, deterministic):
    torch._dynamo.reset()
    torch.backends.cuda.matmul.fp32_precision = precision
    a = torch.randn(*([batch] if batch else []), m, k, device="cuda", dtype=dtype)
    b = torch.randn(*([batch] if batch else []), k, n, device="cuda", dtype=dtype)
    c = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    fn = {"mm": lambda a, b, c: a @ b, "bmm": lambda a, b, c: torch.bmm(a, b),
          "addmm": lambda a, b, c: torch.addmm(c, a, b)}[kind]
    counters = torch._dynamo.utils.counters
    counters.clear()
    DECISIONS.clear()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    # set before each compile: Dynamo ends each frame with torch.use_deterministic_algorithms(prior),
    # which sets Inductor's deterministic back (torch/_dynamo/convert_frame.py)
    torch._inductor.config.deterministic = deterministic
    out = attempt(lambda: torch.compile(fn)(a, b, c))
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    say("grid", name=name, op=kind, m=m, k=k, n=n, batch=batch, bias=bias, dtype=str(dtype), precision=precision,
        deterministic=deterministic, ok=not isinstance(out, str),
        decisions=list(DECISIONS), pad_mm_bench=counters["inductor"]["pad_mm_bench"],
        allocs=[e["size"] for e in trace if e["action"] == "alloc"])


def one_case(*case):
    one(*case)
    torch.cuda.empty_cache()  # the case's tensors died with its frame


def main():
    card_figures()
    watch_pad_mm()
    cases = [(torch.float16, "ieee"), (torch.bfloat16, "ieee"), (torch.float32, "ieee"), (torch.float32, "tf32")]
    for deterministic in (False, True):
        for dtype, precision in cases:
            for case in GRID:
                if dtype == torch.float32 and case[0].startswith("gpt2"):
                    continue  # fp32 copies of the LM head's gradient: 1.6 GB each, same decision path
                one_case(*case, dtype, precision, deterministic)
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
