"""Safe loading of allocator snapshots written by strangers (spec §18.2, §18.3, §18.4, §23).

`load_snapshot` reads a ``torch.cuda.memory._dump_snapshot`` pickle (current or legacy ≤2.0
layout), the same data as JSON, or an RMM ``logging_resource_adaptor`` CSV log, and returns one
normalised dict of plain Python types::

    {"segments": [...], "device_traces": [[...], ...], "allocator_settings": dict | None,
     "format": "pickle" | "json" | "rmm-csv", "legacy": bool, "warnings": [str, ...]}

Snapshot files are untrusted: nothing lost, nothing crashes, nothing wrong accepted.
Input size is checked before reading and read in bounded chunks; pickles and JSON are decoded
to plain data in memory proportional to the file and without native recursion
(`vram.replay.safe_pickle`); every field is then checked and normalised by `_Walker`, and every
segment against the allocator's own invariants (`vram.replay.validate`). Every failure is a
one-line `SnapshotError` naming the file and the path of the offending value (e.g.
``x.pickle: segments[3].blocks[2].size is negative (-1)``); values from the file are described
in bounded space with control characters escaped. Objects shared by reference in a pickle are
normalised once (frames, frame lists) or refused (segments, blocks, trace entries, traces:
PyTorch writes one of each), so a small file cannot make the walk or a replay explode.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Any

from . import ccore
from .messages import Invalid, SnapshotError, brief, int_text, printable
from .rmm import decode_rmm_csv
from .safe_pickle import decode_json, decode_pickle, gc_paused, memory_cap
from .source import DEFAULT_MAX_BYTES, detect, read_source
from .validate import KNOWN_ACTIONS, RESERVED_STREAMS, check_requested, check_segment, check_settings, stream_error

__all__ = ["DEFAULT_MAX_BYTES", "SnapshotError", "load_snapshot", "to_pytorch_snapshot"]

_LIMIT = 2**64  # sizes, addresses and stream handles are 64-bit (spec §18.2)
_SMALL_SEGMENT = 2 * 1024 * 1024  # small-pool segments are exactly 2 MiB (spec §6, §23)
_MAX_PLAIN_NODES, _MAX_PLAIN_DEPTH = 1_000_000, 32
# Block states (spec §18.3); the memory.py docstring's "active_awaiting_free" means pending.
_STATES = {"active_allocated": "active_allocated", "active_pending_free": "active_pending_free",
           "active_awaiting_free": "active_pending_free", "inactive": "inactive"}


def _int(value: Any, path: str, *, positive: bool = False, hi: int = _LIMIT) -> int:
    """An exact int (not bool) in ``[0 or 1, hi)``; sizes/addresses ≥ 2**64 are absurd."""
    if type(value) is not int:
        raise Invalid(f"{path} is not a non-negative int (got {type(value).__name__})")
    if not int(positive) <= value < hi:
        why = "negative" if value < 0 else "absurdly large" if value else "0, must be positive"
        raise Invalid(f"{path} is {why} ({int_text(value)}{f' >= {hi:#x}' if value >= hi else ''})")
    return value


def _stream(value: Any, path: str) -> int:
    got = _int(value, path)
    if got >= RESERVED_STREAMS:
        raise stream_error(path, got)
    return got


_DEFAULT_POOL = (0, 0)


def _pool_id(value: Any, path: str) -> tuple[int, int] | None:
    """A memory pool id (``segment_pool_id``, ``pool_id``): two ints; None for the default (0, 0)."""
    if value is None:
        return None
    if type(value) not in (tuple, list) or len(value) != 2:
        raise Invalid(f"{path} is not a pair of ints (got {brief(value)})")
    pid = (_int(value[0], f"{path}[0]"), _int(value[1], f"{path}[1]"))
    return None if pid == (0, 0) else pid


def _of(value: Any, kind: type, path: str) -> Any:
    if type(value) is not kind:
        raise Invalid(f"{path} is not a {kind.__name__} (got {type(value).__name__})")
    return value


def _req(d: dict[Any, Any], key: str, path: str) -> Any:
    if key not in d:
        raise Invalid(f"{path} has no '{key}'")
    return d[key]


class _Walker:
    """Validates and normalises a decoded snapshot (spec §18.2 trace entries, §18.3 segments).
    Memo dicts are keyed by id(): the decoded tree outlives the walk, so ids stay unique.
    `nbytes` (the file's size) bounds how many nodes ``allocator_settings`` may expand to."""

    def __init__(self, nbytes: int = 0) -> None:
        self.legacy = False
        self._memo: dict[tuple[str, int], Any] = {}  # ("frame", id) -> normalised frame
        self._seen: dict[int, str] = {}  # segments, block lists, blocks, traces: must not repeat
        self._plain_nodes = 0
        self._plain_budget = min(_MAX_PLAIN_NODES, 4096 + nbytes)
        self._frame_by_id: dict[int, dict[str, Any]] = {}  # id(frame dict) -> normalised frame
        self._clean_frames: set[int] = set()  # ids of frame dicts that are already normalised
        self._frame_lists: dict[int, list[dict[str, Any]]] = {}  # id(frames list) -> normalised
        self.unknown: dict[str, int] = {}  # trace actions PyTorch does not write -> count

    def _once(self, obj: Any, path: str) -> None:
        first = self._seen.setdefault(id(obj), path)
        if first != path:
            raise Invalid(f"{path} is the same object as {first} (shared references refused: "
                          "PyTorch writes a new one each time)")

    def snapshot(self, obj: Any) -> dict[str, Any]:
        if type(obj) is list:  # memory_snapshot() output, as _memory_viz treats it (§18.4)
            obj = {"segments": obj, "device_traces": []}
        if type(obj) is not dict:
            raise Invalid(f"not a snapshot: top level is {type(obj).__name__}, "
                          "expected a dict or a list of segments")
        if "segments" not in obj and "device_traces" not in obj:
            raise Invalid("not a snapshot: a dict without 'segments' or 'device_traces'")
        segs = [self.segment(s, f"segments[{i}]")
                for i, s in enumerate(_of(obj.get("segments", []), list, "segments"))]
        order = sorted(range(len(segs)), key=lambda i: (segs[i]["device"], segs[i]["address"]))
        for a, b in zip(order, order[1:]):
            sa, sb = segs[a], segs[b]
            if sa["device"] == sb["device"] and sa["address"] + sa["total_size"] > sb["address"]:
                raise Invalid(f"segments[{a}] and segments[{b}] overlap")
        traces = []
        for d, t in enumerate(_of(obj.get("device_traces", []), list, "device_traces")):
            self._once(_of(t, list, f"device_traces[{d}]"), f"device_traces[{d}]")
            traces.append(self.entries(t, d))
        if traces:  # CUDACachingAllocator::snapshot() writes one trace per device
            for i, s in enumerate(segs):
                if s["device"] >= len(traces):
                    raise Invalid(f"segments[{i}].device is {s['device']}, but device_traces has "
                                  f"{len(traces)} trace(s): PyTorch writes one per device")
        settings = obj.get("allocator_settings")
        if settings is not None:
            settings = self.plain(_of(settings, dict, "allocator_settings"), "allocator_settings", 0)
            check_settings(settings)
        warnings = []
        if self.unknown:
            n = sum(self.unknown.values())
            top = sorted(self.unknown.items(), key=lambda kv: -kv[1])[:5]
            names = ", ".join(f"{brief(a, 24)} x{c:,}" for a, c in top)
            warnings.append(f"{n:,} trace event(s) with unknown actions ({names}"
                            f"{', ...' if len(self.unknown) > 5 else ''}) are not replayed")
        return {"segments": segs, "device_traces": traces, "allocator_settings": settings,
                "legacy": self.legacy, "warnings": warnings}

    def frames(self, value: Any, path: str) -> list[dict[str, Any]]:
        """Frame lists ``[{filename, line, name}]`` (§18.3); shared ones are normalised once."""
        got = self._frame_lists.get(id(value))
        if got is not None:
            return got
        if type(value) is list:
            # Fastest: every frame is a dict already in normalised form (checked once per dict):
            # the list itself is the normalised list, no copy.
            if self._clean_frames.issuperset(map(id, value)):
                self._frame_lists[id(value)] = value
                return value
            seen = self._frame_by_id  # else: every frame was normalised before
            try:
                out = [seen[id(f)] for f in value]
            except KeyError:
                pass
            else:
                self._frame_lists[id(value)] = out
                return out
        out = []
        for i, f in enumerate(_of(value, list, path)):
            if ("frame", id(f)) not in self._memo:
                fp = f"{path}[{i}]"
                name, filename = _req(_of(f, dict, fp), "name", fp), _req(f, "filename", fp)
                if type(name) is not str or type(filename) is not str:
                    raise Invalid(f"{fp} has a non-str name or filename")
                line = _int(_req(f, "line", fp), f"{fp}.line")
                if len(f) == 3:  # exactly {filename, line, name}, all valid: it is its own form
                    self._memo["frame", id(f)] = f
                    self._clean_frames.add(id(f))
                else:
                    self._memo["frame", id(f)] = {"filename": filename, "line": line, "name": name}
                self._frame_by_id[id(f)] = self._memo["frame", id(f)]
            out.append(self._memo["frame", id(f)])
        self._frame_lists[id(value)] = out
        return out

    def segment(self, s: Any, path: str) -> dict[str, Any]:
        """One segment (§18.3): missing device/stream are 0, segment_type comes from the size
        (only small segments are exactly 2 MiB, §23), missing sums are recomputed from blocks;
        then the allocator's invariants (`vram.replay.validate.check_segment`)."""
        self._once(_of(s, dict, path), path)
        address = _int(_req(s, "address", path), f"{path}.address")
        total = _int(_req(s, "total_size", path), f"{path}.total_size", positive=True)
        if address + total > _LIMIT:
            raise Invalid(f"{path} extends past 2**64 (address {address:#x} + {total})")
        kind = s.get("segment_type")
        if kind is None:
            kind = "small" if total == _SMALL_SEGMENT else "large"
        elif type(kind) is not str or kind.lower() not in ("small", "large"):
            raise Invalid(f"{path}.segment_type is not 'small' or 'large' (got {brief(kind)})")
        if type(s.get("is_expandable", False)) is not bool:
            raise Invalid(f"{path}.is_expandable is not a bool (got {brief(s.get('is_expandable'))})")
        raw = _of(_req(s, "blocks", path), list, f"{path}.blocks")
        self._once(raw, f"{path}.blocks")
        if not raw:
            raise Invalid(f"{path}.blocks is empty")
        blocks, offset, sums, exact = [], address, [0, 0, 0], True
        for j, b in enumerate(raw):
            bp = f"{path}.blocks[{j}]"
            self._once(_of(b, dict, bp), bp)
            block, explicit = self.block(b, bp, offset)
            blocks.append(block)
            exact = exact and explicit
            if block["state"] == "active_allocated":
                sums[0] += block["size"]
            if block["state"] != "inactive":
                sums[1] += block["size"]
                sums[2] += block["requested_size"]
            offset += block["size"]
            if offset - address > total:
                break
        if offset - address != total:
            raise Invalid(f"{path}: blocks sum to {offset - address}{'+' if offset - address > total else ''} "
                          f"bytes but total_size is {total}")
        out: dict[str, Any] = {"device": _int(s.get("device", 0), f"{path}.device", hi=2**16),
                               "address": address, "total_size": total}
        for key, derived in zip(("allocated_size", "active_size", "requested_size"), sums):
            if key in s:
                got = _int(s[key], f"{path}.{key}")
                if got != derived and (key != "requested_size" or exact):
                    raise Invalid(f"{path}.{key} is {got} but its blocks give {derived}")
                derived = got
            out[key] = derived
        pool_id = _pool_id(s.get("segment_pool_id"), f"{path}.segment_pool_id")
        if pool_id is not None:  # a private pool's (CUDA graph, MemPool); the default's is left out
            out["segment_pool_id"] = pool_id
        out.update(stream=_stream(s.get("stream", 0), f"{path}.stream"), segment_type=kind.lower(),
                   is_expandable=s.get("is_expandable", False),
                   frames=self.frames(s.get("frames", []), f"{path}.frames"), blocks=blocks)
        check_segment(out, path)
        return out

    def block(self, b: dict[Any, Any], path: str, expected: int) -> tuple[dict[str, Any], bool]:
        """One block (§18.3); its address must be segment address + preceding sizes. Legacy
        (≤2.0) blocks have no address (rebuilt as that) and carry ``history``; as in
        ``_memory_viz._block_extra_legacy`` their frames and a missing requested_size come from
        ``history[0]`` (0 for inactive blocks). Also returns whether requested_size was given."""
        size = _int(_req(b, "size", path), f"{path}.size", positive=True)
        state = _req(b, "state", path)
        if type(state) is not str or state not in _STATES:
            raise Invalid(f"{path}.state is not a known block state (got {brief(state)})")
        if "address" in b:
            addr = _int(b["address"], f"{path}.address")
            if addr != expected:
                raise Invalid(f"{path}.address is {addr:#x} but segment address + preceding "
                              f"sizes is {expected:#x}")
        else:
            self.legacy = True
        first: dict[Any, Any] | None = None
        if b.get("history") is not None:
            self.legacy = True
            history = _of(b["history"], list, f"{path}.history")
            first = _of(history[0], dict, f"{path}.history[0]") if history else None
        explicit = "requested_size" in b
        if explicit:
            requested = _int(b["requested_size"], f"{path}.requested_size")
            check_requested(path, requested, size, _STATES[state])
        elif state == "inactive":
            requested = 0
        elif first is not None:
            hp = f"{path}.history[0]"
            requested = _int(_req(first, "real_size", hp), f"{hp}.real_size")
        else:
            requested = size
        if "frames" in b or first is None:
            frames = self.frames(b.get("frames", []), f"{path}.frames")
        else:
            frames = self.frames(first.get("frames", []), f"{path}.history[0].frames")
        return {"address": expected, "size": size, "requested_size": requested,
                "state": _STATES[state], "frames": frames}, explicit

    def entries(self, trace: list[Any], d: int) -> list[dict[str, Any]]:
        """A device's trace. Ordinary entries take a fast path that checks the same rules
        inline; anything unusual (or wrong) goes through `entry`, which names the problem.
        PyTorch writes a new dict per event: an entry referenced twice (found by its reference
        count, at no cost per entry) would make a small file replay millions of events."""
        c = ccore.loaded()
        if c is not None and type(trace) is list:  # the same walk in C (`vram.replay._ccore.entries`)
            return c.entries(trace, KNOWN_ACTIONS, self.unknown, self._frame_lists, self._clean_frames,
                             lambda fr, k: self._entry_frames(fr, d, k),
                             lambda k: self._shared_entry(trace, k, d),
                             lambda e, k: self.entry(e, f"device_traces[{d}][{k}]"), RESERVED_STREAMS)
        out = []
        lists = self._frame_lists
        known, unknown = KNOWN_ACTIONS, self.unknown
        refs = sys.getrefcount
        base = 0
        probes: list[dict[str, Any]] = [{}]
        for _, probe in enumerate(probes):  # what an unshared entry's count reads in this loop
            base = refs(probe)
        for k, e in enumerate(trace):
            got = None
            if refs(e) > base:
                self._shared_entry(trace, k, d)
            if type(e) is dict:
                action, addr, size = e.get("action"), e.get("addr"), e.get("size")
                stream, t, fr = e.get("stream", 0), e.get("time_us"), e.get("frames")
                if (type(action) is str and 0 < len(action) <= 64 and action != "oom"
                        and type(addr) is int and type(size) is int and type(stream) is int
                        and 0 <= addr < _LIMIT and 0 <= size < _LIMIT and 0 <= stream < RESERVED_STREAMS
                        and (t is None or type(t) is int and 0 <= t < _LIMIT)):
                    if action not in known:
                        unknown[action] = unknown.get(action, 0) + 1
                    if fr is None:
                        frames: list[dict[str, Any]] = []
                    else:
                        frames = lists.get(id(fr))  # type: ignore[assignment]
                        if frames is None:
                            frames = self._entry_frames(fr, d, k)
                    if len(e) == 6 and frames is fr and "stream" in e and "time_us" in e:
                        got = e  # exactly the normalised keys, all checked: its own form
                    elif "pool_id" not in e:  # (one with a pool id goes through `entry`)
                        got = {"action": action, "addr": addr, "size": size, "stream": stream,
                               "time_us": t, "frames": frames}
            out.append(got if got is not None else self.entry(e, f"device_traces[{d}][{k}]"))
        return out

    def _entry_frames(self, fr: Any, d: int, k: int) -> list[dict[str, Any]]:
        """The frames of ``device_traces[d][k]`` (an entry of the ordinary kind), a list not seen before."""
        frames = self._frame_lists.get(id(fr))
        if frames is None:
            if type(fr) is list and self._clean_frames.issuperset(map(id, fr)):
                frames = self._frame_lists[id(fr)] = fr  # every frame already normalised
            else:
                frames = self.frames(fr, f"device_traces[{d}][{k}].frames")
        return frames

    def _shared_entry(self, trace: list[Any], k: int, d: int) -> None:
        """Refuse the dict at ``trace[k]`` if it is referenced twice (ints etc. may repeat)."""
        e = trace[k]
        if type(e) is not dict:
            return
        where = next((f"device_traces[{d}][{j}]" for j in range(k) if trace[j] is e), None)
        if where is None:
            where = next((f"device_traces[{d}][{j}]" for j in range(k + 1, len(trace))
                          if trace[j] is e), "another part of the snapshot")
        raise Invalid(f"device_traces[{d}][{k}] is the same object as {where} (shared references "
                      "refused: PyTorch writes a new dict per event)")

    def entry(self, e: Any, path: str) -> dict[str, Any]:
        """One trace entry (§18.2): action, addr, size, stream, time_us (None if unrecorded),
        frames; an ``oom`` entry has ``device_free`` instead of an address: kept, and copied."""
        action = _req(_of(e, dict, path), "action", path)
        if type(action) is not str or not action or len(action) > 64:
            raise Invalid(f"{path}.action is not a short non-empty str (got {brief(action)})")
        out: dict[str, Any] = {"action": action}
        if action == "oom":
            free = _int(_req(e, "device_free", path), f"{path}.device_free")
            out.update(addr=free, device_free=free)
        else:
            out["addr"] = _int(_req(e, "addr", path), f"{path}.addr")
        out["size"] = _int(_req(e, "size", path), f"{path}.size")
        out["stream"] = _stream(e.get("stream", 0), f"{path}.stream")
        t = e.get("time_us")
        out["time_us"] = None if t is None else _int(t, f"{path}.time_us")
        out["frames"] = self.frames(e.get("frames", []), f"{path}.frames")
        if "pool_id" in e:  # kept for the default pool too: the trace records pools (vram.replay.pool_replay)
            out["pool_id"] = _pool_id(e["pool_id"], f"{path}.pool_id") or _DEFAULT_POOL
        if action not in KNOWN_ACTIONS:
            self.unknown[action] = self.unknown.get(action, 0) + 1
        return out

    def plain(self, v: Any, path: str, depth: int) -> Any:
        """Bounded copy of JSON-like data (allocator_settings, §18.3); tuples become lists."""
        self._plain_nodes += 1
        if self._plain_nodes > self._plain_budget or depth > _MAX_PLAIN_DEPTH:
            raise Invalid(f"{path} is too large or too deeply nested")
        if type(v) is int and not -_LIMIT < v < _LIMIT:  # no setting is wider than 64 bits
            raise Invalid(f"{path} is absurdly large ({int_text(v)})")
        if v is None or type(v) in (bool, int, str) or type(v) is float and math.isfinite(v):
            return v
        if type(v) in (list, tuple):
            return [self.plain(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        if type(v) is dict:
            bad = next((k for k in v if type(k) is not str), None)
            if bad is not None:
                raise Invalid(f"{path} has a non-str key ({brief(bad)})")
            return {k: self.plain(x, f"{path}.{printable(k, 40)}", depth + 1) for k, x in v.items()}
        raise Invalid(f"{path} has a value of type {type(v).__name__} (or is not finite)")


def load_snapshot(source: str | os.PathLike[str] | bytes, *, fmt: str | None = None,
                  max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Load and normalise a snapshot (spec §18.3) from a path or from bytes.

    ``fmt`` is ``"pickle"``, ``"json"``, ``"rmm-csv"`` or None to detect (pickle by its opcode
    magic, JSON by a leading ``{``/``[``, RMM CSV by its header). A top-level list is a
    segments-only snapshot, as ``_memory_viz`` treats it (§18.4). Every segment has device,
    address, total_size, allocated/active/requested_size, stream, segment_type, is_expandable,
    frames and blocks (address, size, requested_size, state, frames); every trace entry has
    exactly action, addr, size, stream, time_us (None when unrecorded), frames, plus
    device_free for ``oom``. ``warnings`` lists what was accepted but will not be replayed.
    Raises `SnapshotError` for anything unreadable, inconsistent or too large: more than
    `max_bytes`, or decoding to more than `vram.replay.safe_pickle.MEMORY_FACTOR` x its size.
    """
    if fmt not in (None, "pickle", "json", "rmm-csv"):
        raise ValueError(f"fmt must be None, 'pickle', 'json' or 'rmm-csv', not {fmt!r}")
    name, data = read_source(source, max_bytes, sniff=fmt is None)
    try:
        if not data:
            raise Invalid("file is empty")
        kind = fmt or detect(data)
        if kind == "rmm-csv":
            with memory_cap(len(data)):
                out = decode_rmm_csv(data)
        else:
            with gc_paused():  # millions of new containers and no garbage: see `gc_paused`
                obj = decode_json(data) if kind == "json" else decode_pickle(data)
                out = _Walker(len(data)).snapshot(obj)
                del obj
    except Invalid as exc:
        raise SnapshotError(f"{name}: {exc}") from None
    except RecursionError:
        raise SnapshotError(f"{name}: nested too deeply to read") from None
    except MemoryError:
        raise SnapshotError(f"{name}: ran out of memory reading {len(data):,} bytes") from None
    out["format"] = kind
    return out


def to_pytorch_snapshot(snap: dict[str, Any]) -> dict[str, Any]:
    """A loaded (normalised) snapshot back in ``torch.cuda.memory._snapshot()``'s shape."""
    traces = []
    for t in snap["device_traces"]:
        entries = []
        for e in t:
            d: dict[str, Any] = {"action": e["action"]}
            d["device_free" if e["action"] == "oom" else "addr"] = e.get("device_free", e["addr"])
            d.update(size=e["size"], stream=e["stream"])
            if e.get("time_us") is not None:
                d["time_us"] = e["time_us"]
            if e.get("frames"):
                d["frames"] = e["frames"]
            if "pool_id" in e:
                d["pool_id"] = e["pool_id"]
            entries.append(d)
        traces.append(entries)
    out: dict[str, Any] = {"segments": snap["segments"], "device_traces": traces}
    if snap.get("allocator_settings") is not None:
        out["allocator_settings"] = snap["allocator_settings"]
    return out
