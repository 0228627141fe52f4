"""Layer 2, the caching allocator: PyTorch's ``CUDACachingAllocator`` algorithm on any `Device`.

`caching.CachingAllocator` (malloc/free, best fit, splitting, the retry chain, streams and
events) with its parts: `block` (blocks and free pools), `expandable` (expandable segments),
`config` (``PYTORCH_CUDA_ALLOC_CONF``), `stats` (``memory_stats()``), `history` (the trace behind
``_record_memory_history``) and `errors` (the OOM message). `native` selects the optional
compiled build of these modules (``VRAM_NATIVE=1``); without it they run as pure Python.
"""
from . import native

native.select(__path__)  # before the modules below are imported

from .caching import CachingAllocator, allocation_size, round_size  # noqa: E402
from .config import AllocatorConfig, ConfigError, parse_alloc_conf  # noqa: E402
from .errors import OutOfMemoryError  # noqa: E402

__all__ = ["AllocatorConfig", "CachingAllocator", "ConfigError", "OutOfMemoryError", "allocation_size",
           "parse_alloc_conf", "round_size"]
