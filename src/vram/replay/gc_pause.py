"""Python's cyclic garbage collector paused around work that makes millions of containers and no
garbage (decoding a snapshot, replaying it)."""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while the block runs, then restore it.

    Decoding a snapshot creates millions of containers (a dict per trace event) and no garbage:
    every allocation of a container counts towards CPython's next collection, and each full
    collection walks every object created so far, so with the collector on ``pickle.load`` of a
    1M-event snapshot spends about 3/4 of its time in the collector (measured: 2.95 s vs 0.67 s,
    README "Speed"). A replay of it (a tuple per event, blocks) would then walk the same
    millions of objects again. Memory use is unchanged; cycles a hostile file builds, and a
    discarded allocator's linked blocks, are collected once the collector runs again.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
