"""Session set-up shared by every test module."""
from __future__ import annotations

try:  # PyPI's torchvision is built for CUDA torch: let it (and transformers, which imports it) load
    from vram.run.cuda.compat import define_torchvision_ops
except ImportError:  # no torch: the tests that need it skip
    pass
else:
    define_torchvision_ops()
