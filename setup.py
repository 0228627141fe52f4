"""The optional C replay core (`vram.replay._ccore`, see vram/replay/ccore.py); everything else is
in pyproject.toml. ``optional=True``: where it cannot be compiled (no C compiler, no Python
headers), the install goes on without it and vram replays in pure Python. ``VRAM_CCORE_REQUIRED=1``
(set by ``python3 -m vram.replay.ccore build``) makes a failed compile an error instead."""
import hashlib
import os
from pathlib import Path

from setuptools import Extension, setup

SOURCE = "src/vram/replay/_ccore.c"
digest = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()
setup(ext_modules=[Extension(
    "vram.replay._ccore", [SOURCE], optional=os.environ.get("VRAM_CCORE_REQUIRED") != "1",
    define_macros=[("CCORE_SOURCE_SHA256", f'"{digest}"')], extra_compile_args=["-O2"])])
