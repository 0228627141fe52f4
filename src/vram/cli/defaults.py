"""Defaults shared by every ``vram`` command, and where each figure comes from.

* ``--gpu``: a program simulated from scratch (``run``, ``estimate``, ``demo``) gets an 80 GiB GPU
  (an H100's size; ``vram gpus`` lists the cards by name). A recording replayed (``replay``,
  ``explain``, ``tune``, ``plot``) gets no limit unless one is given: the recording's own run
  happened on its card, and an OOM it recorded replays at the same event with the free memory
  it recorded.
* ``--context``: the CUDA context, the GPU memory nvidia-smi shows besides PyTorch's reserved
  memory. Measured on an NVIDIA H200 (driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130;
  ``shared/gpu-truth/h200-2026-11-27/context.txt``): device memory used after the first matmul
  774,701,056 B, of which ``memory_reserved()`` 56,623,104 B, so 718,077,952 B (684.8 MiB) once
  cuBLAS's kernels have loaded (552,402,944 B right after ``torch.cuda.init()``; programs that
  ran cuBLAS/cuDNN kernels there showed 678-762 MiB). It depends on the driver, CUDA and the
  kernels loaded: pass ``--context`` for yours (``--context 0`` leaves it out). It is counted
  when judging whether a program fits whenever the GPU's size is known.
"""
from __future__ import annotations

from collections.abc import Sequence

from vram.devices.gpus import CUDA_CONTEXT, context_on

DEFAULT_GPU = "80GiB"
#: CUDA context after the first cuBLAS kernel, H200 / driver 580 / CUDA 13.0 / torch 2.11 (module doc)
DEFAULT_CONTEXT = str(CUDA_CONTEXT)
GPU_HELP = ("GPU: a size (24GiB, 80000000000) or a card (A100-80GB, H100, RTX4090, ...; "
            "'vram gpus' lists them with CUDA's byte counts)")
ARCH_HELP = ("compute capability, e.g. 8.0 or sm_86 (default: the card's; 9.0, an H100, for a "
             "size); it sets the cuBLAS workspace: 32 MiB on sm90, 8,519,680 B elsewhere")
CONTEXT_HELP = ("CUDA context bytes, counted against the GPU as nvidia-smi shows them besides PyTorch's reserved "
                "memory (default 718077952 = 684.8 MiB, measured on an H200 with CUDA 13.0 after the first "
                "cuBLAS kernel; 0 leaves it out)")
REPLAY_CONTEXT_HELP = ("CUDA context bytes with --gpu (default with --gpu: 718077952 = 684.8 MiB, measured on an "
                       "H200 with CUDA 13.0 after the first cuBLAS kernel; without --gpu: 0, the recording's "
                       "free memory already leaves it out)")
TORCH_HINT = ("install PyTorch's CPU wheel (no GPU needed): "
              "pip install torch --index-url https://download.pytorch.org/whl/cpu")
EXIT_CODES = """\
exit status:
  0  done (fits, same, a config without OOM)
  1  the answer is no: does not fit (estimate), the snapshots differ (diff), every config runs out of
     memory (tune); vram run: the script's own status (1 for an uncaught exception, an OOM included)
  2  error: bad arguments or input, stated on one line"""


def check_context(gpu: str, context: int) -> None:
    """A CUDA context as large as the GPU leaves PyTorch nothing: say so, naming ``--context``."""
    from vram.devices.gpus import gpu_memory
    from vram.units import format_size

    total = gpu_memory(gpu, "--gpu")
    if context >= total:
        raise ValueError(f"the CUDA context ({format_size(context)}, --context) leaves nothing of the "
                         f"{format_size(total)} GPU (--gpu): pass a larger --gpu, or --context 0 to leave it out")


def joined_conf(confs: Sequence[str] | str | None) -> str | None:
    """``--conf`` given several times to a command that runs one config: PyTorch's comma-joined
    ``PYTORCH_CUDA_ALLOC_CONF`` (``--conf a:1 --conf b:2`` is ``a:1,b:2``); None when not given."""
    if confs is None or isinstance(confs, str):
        return confs
    return ",".join(c for c in confs if c) if confs else None


def replay_context(gpu: str | None, context: str | None) -> str:
    """The ``--context`` of a replayed recording: as given, else the default with ``--gpu``, else 0."""
    return str(context_on(gpu, context))
