"""The replay loop in C: `vram.replay._ccore`, optional, on by default when built.

``_ccore.c`` repeats, event for event, what the pure-Python engine (`vram.replay.loop.EventLoop` over
`vram.allocator.caching`) does for the replays it models: the caching allocator's malloc, free,
split, merge, rounding, segment sizes, ``empty_cache`` and every statistic, with any
``roundup_power2_divisions``, ``max_split_size_mb``, ``max_non_split_rounding_mb``,
``large_segment_size_mb``, memory fraction and any number of streams. The Python device still
hands out every segment (called back once per ``cudaMalloc`` / ``cudaFree``), so addresses are
the same as in a pure-Python replay.

It refuses, and the pure-Python engine replays, anything else — `unsupported` says why before the
run; the C loop stops (and the replay starts again in Python, from the start) at what it meets
on the way: expandable segments, ``garbage_collection_threshold``, history recording,
``PYTORCH_NO_CUDA_MEMORY_CACHING``, blocks pending on events at the start and ``empty_cache_at``
(an engine option), a free that completes later (held back with an event), a
``cudaMalloc`` that fails (the retry and OOM paths), a recorded ``oom`` and values outside 64-bit
ranges. ``ReplayResult.engine`` says which engine ran, and why not C. Every event's dict is read once (`scan`: an
array of ops), which the rewind's backward walk over the trace (``_ccore.rewind``, see
`vram.replay.rewind._walk_in_c`) and the replay loop share. The loader's check of every trace entry
runs in C too (``_ccore.entries``, see `vram.replay.loader._Walker.entries`).

Built by ``pip install -e .`` / ``pip install .`` when a C compiler is there (``setup.py``: an
optional extension, so an install without one still works), or in place with ``python3 -m
vram.replay.ccore build``; ``... ccore status`` says whether it is used. ``VRAM_CCORE=0`` turns it
off. A build from other sources than the ``_ccore.c`` next to it (edited since) is not used.
``tests/test_ccore.py`` checks that both engines give byte-identical results.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

from vram.allocator.block import Block, SortedKeys
from vram.allocator.stats import ARRAY_STATS, COUNTERS
from vram.devices.trace import TraceDevice

from .gc_pause import gc_paused

if TYPE_CHECKING:
    from vram.allocator.caching import CachingAllocator

ENV = "VRAM_CCORE"
SOURCE = Path(__file__).with_name("_ccore.c")

_module: ModuleType | None = None
_why_not: str | None = None
_loaded = False


def _load() -> tuple[ModuleType | None, str | None]:
    """The built module, or None and why not (once per process)."""
    global _module, _why_not, _loaded
    if not _loaded:
        _loaded = True
        try:
            from . import _ccore  # type: ignore[attr-defined]
        except ImportError as exc:
            _why_not = f"the C core is not built ({exc}; python3 -m vram.replay.ccore build)"
        else:
            built: str | None = getattr(_ccore, "SOURCE_SHA256", None)
            here: str | None
            try:
                here = hashlib.sha256(SOURCE.read_bytes()).hexdigest()
            except OSError:  # an install without the C source: trust the build
                here = built
            if built != here:
                _why_not = "the C core was built from other sources than _ccore.c (rebuild it)"
            else:
                _module = _ccore
    return _module, _why_not


def available() -> str | None:
    """None when the C core can run here, else why not."""
    if os.environ.get(ENV, "") == "0":
        return f"{ENV}=0"
    return _load()[1]


def loaded() -> ModuleType | None:
    """The built module when the C core can run here (`available`), else None."""
    return _module if available() is None else None


class Scan(NamedTuple):
    """A trace's events read once, in C (`scan`), for the rewind and the replay loop."""

    ops: bytes  #: one C ``Op`` per event (action, address, size, stream: what both walks act on)
    segment_allocs: list[tuple[Any, Any]]  #: the (addr, size) of every segment_alloc
    segment_maps: list[tuple[Any, Any]]  #: ... and of every segment_map
    first_pool_id: int | None  #: the first event with a ``pool_id`` key (None: no event has one)
    #: the events whose action is none of alloc, free_requested, free_completed, segment_alloc:
    #: all that verification (`vram.replay.checks.Checks`) reads of the trace
    rare: list[int]


def scan(trace: Sequence[Mapping[str, Any]]) -> Scan | None:
    """`trace` read into C (`Scan`), or None where the C core is not used or the trace has an event
    that is not a dict with a hashable action, or a segment_alloc / _map without addr or size (the
    Python paths read those, and raise)."""
    module = loaded()
    if module is None:
        return None
    with gc_paused():  # it makes a tuple per segment and no garbage cycles (see `gc_paused`)
        got = module.scan(trace)
    return None if got is None else Scan(*got)


def unsupported(alloc: CachingAllocator, dev: TraceDevice, *, empty_cache_at: Collection[int]) -> str | None:
    """Why the C core cannot replay on `alloc` (checked before the run), or None. Cycle skipping
    is no reason: the C core replays every event faster than the Python engine skips periods
    (README, Speed), so `replay` runs it whether skipping was asked for or not."""
    why = available()
    if why is not None:
        return why
    config = alloc.config
    if empty_cache_at:
        return "empty_cache_at is given"
    if config.expandable_segments or alloc.expandable_segments:
        return "expandable segments"
    if alloc._gc_active():
        return "garbage_collection_threshold with a memory fraction"
    if alloc.caching_disabled or alloc.uncached:
        return "caching is disabled (PYTORCH_NO_CUDA_MEMORY_CACHING)"
    if alloc.history.enabled:
        return "history recording is on"
    if alloc.cuda_events or alloc.deferred_frees:
        return "blocks pending on events at the start"
    if alloc.graph_pools or getattr(dev, "pool_router", None) is not None:
        return "private memory pools (CUDA graphs, MemPool)"
    if not isinstance(dev, TraceDevice) or dev.fail_mallocs:
        return "not a replay device"
    if alloc.small_blocks.get_free_blocks_call_count or alloc.large_blocks.get_free_blocks_call_count:
        return "garbage-collection clocks already started"
    return None


def _stats_out(alloc: CachingAllocator) -> list[int]:
    stats = alloc.stats
    out = [getattr(s, f) for name in ARRAY_STATS for s in getattr(stats, name)
           for f in ("current", "peak", "allocated", "freed")]
    out += [getattr(s, f) for s in (stats.oversize_allocations, stats.oversize_segments)
            for f in ("current", "peak", "allocated", "freed")]
    return out + [getattr(stats, name) for name in COUNTERS] + [alloc.total_allocated_memory]


def _stats_in(alloc: CachingAllocator, values: Sequence[int]) -> None:
    stats = alloc.stats
    it = iter(values)
    for s in [s for name in ARRAY_STATS for s in getattr(stats, name)] + [stats.oversize_allocations,
                                                                             stats.oversize_segments]:
        s.current, s.peak, s.allocated, s.freed = next(it), next(it), next(it), next(it)
    for name in COUNTERS:
        setattr(stats, name, next(it))
    alloc.total_allocated_memory = next(it)


_Row = tuple[int, int, int, int, bool, bool, Any, Any, int, bool]


def _blocks_out(alloc: CachingAllocator) -> list[_Row] | None:
    """Every block, segment by segment, for the C core; None if one is outside what it models.
    A block's seq is its position in its pool's or `active`'s dict (whose order the C core keeps)."""
    seq: dict[int, int] = {}
    for known in [*alloc.large_blocks.blocks.values(), *alloc.small_blocks.blocks.values(), *alloc.active.values()]:
        seq[id(known)] = len(seq)
    out: list[_Row] = []
    for head in alloc.all_blocks():
        if head.prev is not None:
            continue
        b = head
        while True:
            if (b.event_count or b.stream_uses or not b.mapped or b.expandable_segment is not None
                    or id(b) not in seq or b.allocated != (alloc.active.get(b.ptr) is b)):
                return None
            out.append((b.ptr, b.size, b.requested_size, b.stream, b.pool.is_small, b.allocated, b.frames,
                        b.segment_frames, seq[id(b)], b is head))
            if b.next is None:
                break
            b = b.next
    return out


def _blocks_in(alloc: CachingAllocator, rows: Sequence[_Row]) -> None:
    """Rebuild the pools and `active` from the C core's blocks (dict orders as the C core kept them)."""
    pools = {True: alloc.small_blocks, False: alloc.large_blocks}
    for pool in pools.values():
        pool.keys = SortedKeys()
        pool.blocks = {}
    alloc.active.clear()
    free: list[tuple[int, Block]] = []
    live: list[tuple[int, Block]] = []
    prev: Block | None = None
    for ptr, size, requested, stream, small, allocated, frames, seg_frames, seq, head in rows:
        b = Block(stream, size, pools[small], ptr)
        b.requested_size = requested
        b.allocated = allocated
        b.frames = frames
        b.segment_frames = seg_frames
        if not head:
            b.prev = prev
            prev.next = b  # type: ignore[union-attr]
        prev = b
        (live if allocated else free).append((seq, b))
    free.sort(key=lambda x: x[0])
    live.sort(key=lambda x: x[0])
    for _, b in free:
        b.pool.insert(b)
    for _, b in live:
        alloc.active[b.ptr] = b


def run(alloc: CachingAllocator, dev: TraceDevice, events: Scan | None, n: int, result: Any,
        checks: Any, verify: bool, progress: Callable[[int, int], None] | None, live_at_start: set[int],
        track_peak: bool = True) -> tuple[str | None, bool]:
    """Replay the first `n` events of a trace (read by `scan`) on `alloc` in C, as
    `vram.replay.loop.EventLoop` does; (None, True) when done, else (why not, whether the device was
    touched: then replay again from a fresh start)."""
    module, why = _load()
    if module is None:
        return why, False
    if events is None:
        return "an event that is not a dict with a hashable action, or a segment without addr or size", False
    rows = _blocks_out(alloc)
    if rows is None:
        return "a block state the C core does not model", False
    config = alloc.config
    conf = (list(config.roundup_power2_divisions), config.max_split_size, config.max_non_split_rounding,
            config.large_segment_size, alloc.allowed_memory_maximum)
    got = module.run(events.ops, n, conf, rows, _stats_out(alloc), live_at_start, dev.malloc, dev.free,
                     verify, progress, result.timeline is not None, track_peak)
    if isinstance(got, str):
        return got, True
    blocks, stats, peak_event, at_peak, largest, total, matched, notes, tl_a, tl_r = got
    _blocks_in(alloc, blocks)
    _stats_in(alloc, stats)
    result.reserved_peak_event = peak_event
    result.allocated_at_reserved_peak = at_peak
    result.largest_free_block_at_reserved_peak = largest
    if checks is not None:
        checks.allocs_total += total
        checks.allocs_matched += matched
        for i, kind, expected, actual in notes:
            if kind == 0:
                checks.note(i, "alloc_address", f"{expected:#x}", f"{actual:#x}")
            else:
                checks.note(i, "free", "a live block", "none at that address")
    if result.timeline is not None:
        result.timeline[0].frombytes(tl_a)
        result.timeline[1].frombytes(tl_r)
    if progress is not None:
        progress(n, n)
    return None, True


# -- building it in place ------------------------------------------------------------------------

def build(quiet: bool = True) -> Path:
    """Compile ``_ccore.c`` into this folder (``setup.py build_ext --inplace`` on a copy, so a
    failed build leaves nothing behind); returns the module's path. Raises RuntimeError."""
    root = SOURCE.parents[3]
    setup = root / "setup.py"
    if not setup.is_file():
        raise RuntimeError(f"no setup.py at {root}: build from a source checkout")
    with tempfile.TemporaryDirectory(prefix="vram-ccore-") as tmp:
        work = Path(tmp)
        for name in ("setup.py", "pyproject.toml", "README.md"):  # the project's own build settings
            shutil.copy2(root / name, work / name)
        (work / "src" / "vram" / "replay").mkdir(parents=True)
        (work / "src" / "vram" / "__init__.py").touch()
        (work / "src" / "vram" / "replay" / "__init__.py").touch()
        shutil.copy2(SOURCE, work / "src" / "vram" / "replay" / SOURCE.name)
        proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=work,
                              capture_output=True, text=True, env={**os.environ, "VRAM_CCORE_REQUIRED": "1"})
        built = sorted((work / "src" / "vram" / "replay").glob("_ccore*.so")) + \
            sorted((work / "src" / "vram" / "replay").glob("_ccore*.pyd"))
        if proc.returncode != 0 or not built:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"building the C core failed:\n{tail}")
        target = SOURCE.parent / built[0].name
        partial = SOURCE.parent / f".{built[0].name}.{os.getpid()}.partial"
        shutil.copy2(built[0], partial)
        for old in [*SOURCE.parent.glob("_ccore*.so"), *SOURCE.parent.glob("_ccore*.pyd")]:
            if old != target:
                old.unlink()
        os.replace(partial, target)  # another process loading it meanwhile sees the old file or the new, whole
    if not quiet:
        print(f"built {target}")
    return target


def _status() -> int:
    why = available()
    print(f"C replay core: {'used' if why is None else 'not used: ' + why}")
    return 0


def _build() -> int:
    try:
        build(quiet=False)
    except (RuntimeError, OSError) as exc:
        print(f"vram: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python3 -m vram.replay.ccore build | status``."""
    args = sys.argv[1:] if argv is None else argv
    command = {"build": _build, "status": _status}.get(args[0]) if len(args) == 1 else None
    if command is None:
        print("usage: python3 -m vram.replay.ccore build | status", file=sys.stderr)
        return 2
    return command()


if __name__ == "__main__":
    sys.exit(main())

