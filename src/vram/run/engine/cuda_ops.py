"""Which aten ops have a CUDA kernel of their own, read from the installed torch's
``native_functions.yaml`` (a CPU build registers no CUDA kernels to ask the dispatcher about):
the engine runs those whole, as CUDA's kernel does, instead of through another device's composite."""
from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def cuda_kernel_ops() -> frozenset[str]:
    """The aten ops with a CUDA kernel of their own, from the ``dispatch:`` entries of the
    installed torch's ``native_functions.yaml`` (torchgen/packaged; a CPU build registers no CUDA
    kernels to ask the dispatcher about). Empty when torchgen's copy is missing."""
    import torchgen

    path = os.path.join(os.path.dirname(torchgen.__file__), "packaged", "ATen", "native", "native_functions.yaml")
    found: set[str] = set()
    name, in_dispatch = "", False
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("- func:"):
                    name, in_dispatch = line[len("- func:"):].strip().split("(", 1)[0], False
                elif line.startswith("  dispatch:"):
                    in_dispatch = True
                elif in_dispatch and line.startswith("    ") and ":" in line:
                    if "CUDA" in (k.strip() for k in line.split(":", 1)[0].split(",")):
                        found.add("aten::" + name)
                elif not line.startswith("    "):
                    in_dispatch = False
    except OSError:
        return frozenset()
    return frozenset(found)
