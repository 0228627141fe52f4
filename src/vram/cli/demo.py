"""``vram demo``: the classic GPU-memory experiments on a simulated GPU — reserved vs allocated,
the cache after ``del``, fragmentation that ``empty_cache`` cannot return, the summary table and
PyTorch's OOM message."""
from __future__ import annotations

from vram.devices.gpus import gpu_memory
from vram.units import parse_size

MiB = 1024 * 1024


def _mib(n: int) -> str:
    if n < MiB:
        return f"{n / 1024:,.1f} KiB"
    return f"{n / MiB:,.1f} MiB"


def run_demo(gpu: str, context: str, conf: str | None) -> int:
    import vram

    vram.simulate(total_memory=gpu_memory(gpu, "--gpu"), context=context, alloc_conf=conf)  # a size or a card
    total = vram.get_device().total_memory
    print(f"Simulated GPU: {_mib(total)} total, {_mib(parse_size(context))} CUDA context, "
          f"PYTORCH_CUDA_ALLOC_CONF={conf or ''!r}\n")

    def line(what: str) -> None:
        free, _ = vram.mem_get_info()
        print(f"{what:<52} allocated {_mib(vram.memory_allocated()):>14}   "
              f"reserved {_mib(vram.memory_reserved()):>14}   free {_mib(free):>14}")

    line("start")
    x = vram.empty(1000)                      # 1000 floats = 4000 bytes
    line("x = empty(1000) float32 (4000 B -> 4096 B block)")
    del x
    line("del x (block back in the cache)")
    vram.empty_cache()
    line("empty_cache() (whole free segment returned)")

    blocks = [vram.empty(4 * MiB // 4) for _ in range(4)]  # 4 MiB each, share one 20 MiB segment
    line("four 4 MiB tensors (one 20 MiB segment)")
    del blocks[:2]
    line("free the first two (a free 8 MiB hole)")
    vram.empty_cache()
    line("empty_cache() (segment still in use: nothing freed)")
    big = vram.empty(100 * MiB // 4)
    line("a 100 MiB tensor (its own segment)")
    alias = big[: 10]
    del big
    line("del big, a view of it still alive")
    del alias
    line("del the view too")
    vram.empty_cache()
    line("empty_cache()")
    print()
    print(vram.memory_summary(abbreviated=True))

    free, _ = vram.mem_get_info()
    print(f"Now ask for more than is free ({_mib(free)}):")
    try:
        vram.empty(free // 4 + MiB)
    except vram.OutOfMemoryError as e:
        print(f"torch.OutOfMemoryError: {e}")
    return 0
