"""How much of the simulated GPU's memory contents a run keeps on the host: the size limit of a
storage's known values, and the error when host memory cannot hold the copies of a real-values run."""
from __future__ import annotations

#: Elements of a storage whose contents are kept on the CPU when known (64 Ki: masks, ids,
#: scalars; see `vram.run.values.known`). A host storage moved over keeps up to as many float32s.
VALUE_LIMIT = 1 << 16


class HostMemoryError(Exception):
    """The CPU copies of a real-values run (`vram.run.values.real_values`) do not fit in host memory."""
