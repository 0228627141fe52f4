"""Layer 4, the ``torch.cuda``-shaped front end: `memory` (``torch.cuda.memory``'s API over
simulated GPUs: ``simulate``, ``memory_allocated``, ``_dump_snapshot`` …) and `tensor` (buffers
whose memory is freed when the last reference dies: ``vram.empty``)."""
