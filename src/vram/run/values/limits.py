"""How much of the simulated GPU's memory contents a run keeps on the host: the size limit of a
storage's known values, and the error when host memory cannot hold the copies of a real-values run."""
from __future__ import annotations

#: Elements of a storage whose contents are kept on the CPU when known (64 Ki: masks, ids,
#: scalars; see `vram.run.values.known`). A host storage moved over keeps up to as many float32s.
VALUE_LIMIT = 1 << 16
#: Elements of an output kept when it is computed, by a deterministic op, from simulated tensors
#: whose values are all kept (and small host tensors): constants a kernel derives from known ones
#: (istft's window envelope: the window's squares expanded over every frame, overlap-added;
#: rotary tables: known positions times known frequencies). Such an output costs the host one
#: pass over at most this many elements; the values of factories and host data keep `VALUE_LIMIT`.
DERIVED_LIMIT = 1 << 20


class HostMemoryError(Exception):
    """The CPU copies of a real-values run (`vram.run.values.real_values`) do not fit in host memory."""
