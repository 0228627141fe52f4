"""Safe loading of allocator snapshots written by strangers (spec §18.2, §18.3, §18.4, §23).

`load_snapshot` reads a ``torch.cuda.memory._dump_snapshot`` pickle (current or legacy ≤2.0
layout), the same data as JSON, or an RMM ``logging_resource_adaptor`` CSV log, and returns one
normalised dict of plain Python types::

    {"segments": [...], "device_traces": [[...], ...], "allocator_settings": dict | None,
     "format": "pickle" | "json" | "rmm-csv", "legacy": bool}

Snapshot files are untrusted. Pickles go through a plain-data unpickler that refuses every
global (the six recordings of §23 need none), every persistent id and every opcode that calls
or builds objects; input size is capped; every decoding failure and structural problem becomes
a one-line `SnapshotError` naming the file and the path of the offending value (e.g.
``x.pickle: segments[3].blocks[2].size is not a non-negative int``). Objects shared by
reference in a pickle are normalised once (frames, trace entries) or refused (segments,
blocks), so a small hostile file cannot make the walk explode.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import pickle
import re
import struct
from typing import Any

__all__ = ["DEFAULT_MAX_BYTES", "SnapshotError", "load_snapshot", "to_pytorch_snapshot"]

DEFAULT_MAX_BYTES = 2 * 1024**3
_LIMIT = 2**64  # sizes, addresses and stream handles are 64-bit (spec §18.2)
_SMALL_SEGMENT = 2 * 1024 * 1024  # small-pool segments are exactly 2 MiB (spec §6, §23)
_MAX_PLAIN_NODES, _MAX_PLAIN_DEPTH = 1_000_000, 32
# Block states (spec §18.3); the memory.py docstring's "active_awaiting_free" means pending.
_STATES = {"active_allocated": "active_allocated", "active_pending_free": "active_pending_free",
           "active_awaiting_free": "active_pending_free", "inactive": "inactive"}
_RMM_HEADER = "Thread,Time,Action,Pointer,Size,Stream"
_NUMBER = re.compile(r"0x[0-9a-f]{1,16}|[0-9]{1,20}")
_CLOCK = re.compile(r"([0-9]{1,2}):([0-9]{2}):([0-9]{2})(?:[.:]([0-9]{1,6}))?")
_EPOCH = re.compile(r"([0-9]{1,12})(?:\.([0-9]{1,6}))?")
# (module, name) pairs a snapshot pickle may reference. Real snapshots use none (§23).
_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset()
_REFUSED_OPCODES = ("REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1", "EXT2",
                    "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER")
_DECODE_ERRORS = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError,
                  AttributeError, struct.error, MemoryError, RecursionError, OverflowError,
                  UnicodeDecodeError, csv.Error)


class SnapshotError(ValueError):
    """A snapshot file that cannot be read: one line, ``"<file>: <what is wrong>"``."""


class _Invalid(Exception):
    """Internal: a problem found while decoding or walking; `load_snapshot` adds the file name."""


def _refuser(name: str) -> Any:
    def refuse(self: Any) -> None:
        raise pickle.UnpicklingError(f"refused opcode {name} (snapshots are plain data: no "
                                     "calls, objects, extensions, persistent ids or buffers)")
    return refuse


class _SafeUnpickler(pickle._Unpickler):
    """Plain-data unpickler. Built on the pure-Python unpickler, whose memo is a dict: the C one
    grows an array to any PUT index, so a 10-byte file can claim gigabytes. Opcodes that call or
    build objects are removed from its dispatch table, not just starved of globals (EXT1/2/4
    skip `find_class` once copyreg's cache is warm); other globals are refused by name."""

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch.update({getattr(pickle, op)[0]: _refuser(op) for op in _REFUSED_OPCODES})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refused pickled global {module}.{name} (snapshots are plain data)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id (snapshots are plain data)")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _int(value: Any, path: str, *, positive: bool = False, hi: int = _LIMIT) -> int:
    """An exact int (not bool) in ``[0 or 1, hi)``; sizes/addresses ≥ 2**64 are absurd."""
    if type(value) is not int:
        raise _Invalid(f"{path} is not a non-negative int (got {type(value).__name__})")
    if not int(positive) <= value < hi:
        why = "negative" if value < 0 else "absurdly large" if value else "0, must be positive"
        raise _Invalid(f"{path} is {why} ({value}{f' >= {hi:#x}' if value >= hi else ''})")
    return value


def _of(value: Any, kind: type, path: str) -> Any:
    if type(value) is not kind:
        raise _Invalid(f"{path} is not a {kind.__name__} (got {type(value).__name__})")
    return value


def _req(d: dict[Any, Any], key: str, path: str) -> Any:
    if key not in d:
        raise _Invalid(f"{path} has no '{key}'")
    return d[key]


class _Walker:
    """Validates and normalises a decoded snapshot (spec §18.2 trace entries, §18.3 segments).
    Memo dicts are keyed by id(): the decoded tree outlives the walk, so ids stay unique."""

    def __init__(self) -> None:
        self.legacy = False
        self._memo: dict[tuple[str, int], Any] = {}  # frames lists, frames, entries, traces
        self._seen: dict[int, str] = {}  # segments, block lists, blocks: must not repeat
        self._plain_nodes = 0
        self._frame_by_id: dict[int, dict[str, Any]] = {}  # id(frame dict) -> normalised frame
        self._clean_frames: set[int] = set()  # ids of frame dicts that are already normalised
        self._frame_lists: dict[int, list[dict[str, Any]]] = {}  # id(frames list) -> normalised

    def _once(self, obj: Any, path: str) -> None:
        first = self._seen.setdefault(id(obj), path)
        if first != path:
            raise _Invalid(f"{path} is the same object as {first} (shared references refused)")

    def snapshot(self, obj: Any) -> dict[str, Any]:
        if type(obj) is list:  # memory_snapshot() output, as _memory_viz treats it (§18.4)
            obj = {"segments": obj, "device_traces": []}
        if type(obj) is not dict:
            raise _Invalid(f"not a snapshot: top level is {type(obj).__name__}, "
                           "expected a dict or a list of segments")
        if "segments" not in obj and "device_traces" not in obj:
            raise _Invalid("not a snapshot: a dict without 'segments' or 'device_traces'")
        segs = [self.segment(s, f"segments[{i}]")
                for i, s in enumerate(_of(obj.get("segments", []), list, "segments"))]
        order = sorted(range(len(segs)), key=lambda i: (segs[i]["device"], segs[i]["address"]))
        for a, b in zip(order, order[1:]):
            sa, sb = segs[a], segs[b]
            if sa["device"] == sb["device"] and sa["address"] + sa["total_size"] > sb["address"]:
                raise _Invalid(f"segments[{a}] and segments[{b}] overlap")
        traces = []
        for d, t in enumerate(_of(obj.get("device_traces", []), list, "device_traces")):
            if ("trace", id(t)) not in self._memo:
                self._memo["trace", id(t)] = self.entries(_of(t, list, f"device_traces[{d}]"), d)
            traces.append(self._memo["trace", id(t)])
        settings = obj.get("allocator_settings")
        if settings is not None:
            settings = self.plain(_of(settings, dict, "allocator_settings"),
                                  "allocator_settings", 0)
        return {"segments": segs, "device_traces": traces, "allocator_settings": settings,
                "legacy": self.legacy}

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
                    raise _Invalid(f"{fp} has a non-str name or filename")
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
        (only small segments are exactly 2 MiB, §23), missing sums are recomputed from blocks."""
        self._once(_of(s, dict, path), path)
        address = _int(_req(s, "address", path), f"{path}.address")
        total = _int(_req(s, "total_size", path), f"{path}.total_size", positive=True)
        if address + total > _LIMIT:
            raise _Invalid(f"{path} extends past 2**64 (address {address:#x} + {total})")
        kind = s.get("segment_type")
        if kind is None:
            kind = "small" if total == _SMALL_SEGMENT else "large"
        elif type(kind) is not str or kind.lower() not in ("small", "large"):
            raise _Invalid(f"{path}.segment_type is not 'small' or 'large' ({kind!r:.40})")
        if type(s.get("is_expandable", False)) is not bool:
            raise _Invalid(f"{path}.is_expandable is not a bool")
        raw = _of(_req(s, "blocks", path), list, f"{path}.blocks")
        self._once(raw, f"{path}.blocks")
        if not raw:
            raise _Invalid(f"{path}.blocks is empty")
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
        if offset - address != total:
            raise _Invalid(f"{path}: blocks sum to {offset - address} bytes "
                           f"but total_size is {total}")
        out: dict[str, Any] = {"device": _int(s.get("device", 0), f"{path}.device", hi=2**16),
                               "address": address, "total_size": total}
        for key, derived in zip(("allocated_size", "active_size", "requested_size"), sums):
            if key in s:
                got = _int(s[key], f"{path}.{key}")
                if got != derived and (key != "requested_size" or exact):
                    raise _Invalid(f"{path}.{key} is {got} but its blocks give {derived}")
                derived = got
            out[key] = derived
        out.update(stream=_int(s.get("stream", 0), f"{path}.stream"), segment_type=kind.lower(),
                   is_expandable=s.get("is_expandable", False),
                   frames=self.frames(s.get("frames", []), f"{path}.frames"), blocks=blocks)
        return out

    def block(self, b: dict[Any, Any], path: str, expected: int) -> tuple[dict[str, Any], bool]:
        """One block (§18.3); its address must be segment address + preceding sizes. Legacy
        (≤2.0) blocks have no address (rebuilt as that) and carry ``history``; as in
        ``_memory_viz._block_extra_legacy`` their frames and a missing requested_size come from
        ``history[0]`` (0 for inactive blocks). Also returns whether requested_size was given."""
        size = _int(_req(b, "size", path), f"{path}.size", positive=True)
        state = _req(b, "state", path)
        if type(state) is not str or state not in _STATES:
            raise _Invalid(f"{path}.state is not a known block state ({state!r:.40})")
        if "address" in b:
            addr = _int(b["address"], f"{path}.address")
            if addr != expected:
                raise _Invalid(f"{path}.address is {addr:#x} but segment address + preceding "
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
        inline; anything unusual (or wrong) goes through `entry`, which names the problem."""
        out = []
        memo = self._memo
        lists, clean = self._frame_lists, self._clean_frames
        for k, e in enumerate(trace):
            got = None
            if type(e) is dict and ("entry", id(e)) not in memo:
                action, addr, size = e.get("action"), e.get("addr"), e.get("size")
                stream, t, fr = e.get("stream", 0), e.get("time_us"), e.get("frames")
                if (type(action) is str and 0 < len(action) <= 64 and action != "oom"
                        and type(addr) is int and type(size) is int and type(stream) is int
                        and 0 <= addr < _LIMIT and 0 <= size < _LIMIT and 0 <= stream < _LIMIT
                        and (t is None or type(t) is int and 0 <= t < _LIMIT)):
                    if fr is None:
                        frames: list[dict[str, Any]] = []
                    else:
                        frames = lists.get(id(fr))  # type: ignore[assignment]
                        if frames is None:
                            if type(fr) is list and clean.issuperset(map(id, fr)):
                                frames = lists[id(fr)] = fr  # every frame already normalised
                            else:
                                frames = self.frames(fr, f"device_traces[{d}][{k}].frames")
                    if len(e) == 6 and frames is fr and "stream" in e and "time_us" in e:
                        got = e  # exactly the normalised keys, all checked: its own form
                    else:
                        got = {"action": action, "addr": addr, "size": size, "stream": stream,
                               "time_us": t, "frames": frames}
            out.append(got if got is not None else self.entry(e, f"device_traces[{d}][{k}]"))
        return out

    def entry(self, e: Any, path: str) -> dict[str, Any]:
        """One trace entry (§18.2): action, addr, size, stream, time_us (None if unrecorded),
        frames; an ``oom`` entry has ``device_free`` instead of an address: kept, and copied."""
        if ("entry", id(e)) in self._memo:
            return self._memo["entry", id(e)]
        action = _req(_of(e, dict, path), "action", path)
        if type(action) is not str or not action or len(action) > 64:
            raise _Invalid(f"{path}.action is not a short non-empty str")
        out: dict[str, Any] = {"action": action}
        if action == "oom":
            free = _int(_req(e, "device_free", path), f"{path}.device_free")
            out.update(addr=free, device_free=free)
        else:
            out["addr"] = _int(_req(e, "addr", path), f"{path}.addr")
        out["size"] = _int(_req(e, "size", path), f"{path}.size")
        out["stream"] = _int(e.get("stream", 0), f"{path}.stream")
        t = e.get("time_us")
        out["time_us"] = None if t is None else _int(t, f"{path}.time_us")
        out["frames"] = self.frames(e.get("frames", []), f"{path}.frames")
        self._memo["entry", id(e)] = out
        return out

    def plain(self, v: Any, path: str, depth: int) -> Any:
        """Bounded copy of JSON-like data (allocator_settings, §18.3); tuples become lists."""
        self._plain_nodes += 1
        if self._plain_nodes > _MAX_PLAIN_NODES or depth > _MAX_PLAIN_DEPTH:
            raise _Invalid(f"{path} is too large or too deeply nested")
        if v is None or type(v) in (bool, int, str) or type(v) is float and math.isfinite(v):
            return v
        if type(v) in (list, tuple):
            return [self.plain(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        if type(v) is dict:
            bad = [k for k in v if type(k) is not str]
            if bad:
                raise _Invalid(f"{path} has a non-str key {bad[0]!r:.40}")
            return {k: self.plain(x, f"{path}.{k}", depth + 1) for k, x in v.items()}
        raise _Invalid(f"{path} has a value of type {type(v).__name__} (or is not finite)")


class _FastSafeUnpickler(pickle.Unpickler):
    """The C unpickler with every global and persistent id refused. Without a global nothing
    callable can reach the stack, so REDUCE/BUILD/NEWOBJ fail on plain data; EXT opcodes are
    only safe while copyreg's extension registry is empty (checked before use). Its memo can be
    grown by a hostile PUT index: `_guarded_load` caps the address space while it runs."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused pickled global {module}.{name} (snapshots are plain data)")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused persistent id (snapshots are plain data)")


def _guarded_load(stream: io.BytesIO, size: int) -> Any:
    """Unpickle with the C unpickler (about 5x faster) under a temporary RLIMIT_AS of the
    current address space + 64 x the input + 256 MiB, so a memo bomb fails with MemoryError
    instead of taking the machine's memory. `_SafeUnpickler` decides whenever the C path fails,
    and wherever the guard is unavailable (no `resource`, no /proc) or copyreg has extensions
    registered."""
    import copyreg

    try:
        import resource

        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError, AttributeError):
        return _SafeUnpickler(stream).load()
    if copyreg._extension_registry or copyreg._extension_cache:  # type: ignore[attr-defined]
        return _SafeUnpickler(stream).load()
    cap = vm + 64 * size + (256 << 20)
    for limit in (soft, hard):
        if limit != resource.RLIM_INFINITY:
            cap = min(cap, limit)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        return _FastSafeUnpickler(stream).load()
    except Exception:  # noqa: BLE001 - any failure: the exact pure-Python path decides
        pass
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    # A refused opcode, a corrupt file, or a memo index too large for the C unpickler's array
    # (valid pickle: the pure-Python memo is a dict). The slow path gives the canonical answer.
    stream.seek(0)
    return _SafeUnpickler(stream).load()


def _decode(kind: str, data: bytes) -> Any:
    """Pickle (through a plain-data unpickler, nothing may follow its STOP) or JSON to plain data."""
    stream = io.BytesIO(data)
    try:
        if kind == "json":
            return json.loads(data.decode("utf-8-sig"))  # NaN/Infinity: refused by the walk
        obj = _guarded_load(stream, len(data))
    except _DECODE_ERRORS as exc:
        raise _Invalid(f"unreadable {kind.replace('json', 'JSON')}: {_one_line(exc)}") from None
    if stream.tell() != len(data):
        raise _Invalid(f"{len(data) - stream.tell()} trailing bytes after the pickle")
    return obj


def _rmm_number(text: str, path: str) -> int:
    t = text.strip().lower()
    if not _NUMBER.fullmatch(t):
        raise _Invalid(f"{path} is not a number ({text[:40]!r})")
    return _int(int(t, 0 if t.startswith("0x") else 10), path)


def _rmm_time(text: str, path: str) -> tuple[int, bool]:
    """(µs, is time of day): ``HH:MM:SS.ffffff`` (spdlog ``%H:%M:%S.%f``; ``:`` before the
    fraction as in RMM's replay parser's doc) or seconds since the epoch (RMM's user guide)."""
    if m := _CLOCK.fullmatch(text.strip()):
        h, mi, s, us = (int(g) for g in (m[1], m[2], m[3], (m[4] or "").ljust(6, "0")))
        return ((h * 60 + mi) * 60 + s) * 10**6 + us, True
    if m := _EPOCH.fullmatch(text.strip()):
        return int(m[1]) * 10**6 + int((m[2] or "").ljust(6, "0")), False
    raise _Invalid(f"{path} is not a time ({text[:40]!r})")


def _decode_rmm_csv(data: bytes) -> dict[str, Any]:
    """RMM ``logging_resource_adaptor`` log (``Thread,Time,Action,Pointer,Size,Stream``; actions
    allocate / free / allocate failure) as §18.2 entries on device 0: alloc; free_requested +
    free_completed (RMM frees at once); oom with device_free 0 (RMM does not log it)."""
    try:
        lines = data.decode("utf-8-sig").splitlines()
        rows = list(csv.reader(lines[1:]))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise _Invalid(f"unreadable CSV: {_one_line(exc)}") from None
    if not lines or lines[0].strip() != _RMM_HEADER:
        raise _Invalid(f"not an RMM log: first line is not {_RMM_HEADER!r}")
    entries: list[dict[str, Any]] = []
    day, last = 0, -1
    for n, row in enumerate(rows, start=2):
        if not "".join(row).strip():
            continue
        if len(row) != 6:
            raise _Invalid(f"line {n} has {len(row)} fields, expected 6")
        _rmm_number(row[0], f"line {n} Thread")
        time_us, of_day = _rmm_time(row[1], f"line {n} Time")
        if of_day:  # time of day only: a backwards jump of more than 12 h is the next day
            day, last = day + (time_us + 43_200 * 10**6 < last), time_us
            time_us += day * 86_400 * 10**6
        action, ptr = row[2].strip(), _rmm_number(row[3], f"line {n} Pointer")
        common = {"size": _rmm_number(row[4], f"line {n} Size"),
                  "stream": _rmm_number(row[5], f"line {n} Stream"), "time_us": time_us}
        if action == "allocate":
            entries.append({"action": "alloc", "addr": ptr, **common, "frames": []})
        elif action in ("free", "deallocate"):
            entries += [{"action": a, "addr": ptr, **common, "frames": []}
                        for a in ("free_requested", "free_completed")]
        elif action == "allocate failure":
            entries.append({"action": "oom", "addr": 0, "device_free": 0, **common,
                            "frames": []})
        else:
            raise _Invalid(f"line {n} Action is not allocate/free/allocate failure "
                           f"({action[:40]!r})")
    return {"segments": [], "device_traces": [entries], "allocator_settings": None,
            "legacy": False}


def _detect(data: bytes) -> str:
    """Pickle protocol 2+ opens with PROTO (0x80); JSON with ``{``/``[``; RMM with its header;
    anything else ending in the STOP opcode ``.`` is tried as a protocol 0/1 pickle."""
    text = data.lstrip(b"\xef\xbb\xbf")
    if data[:1] == b"\x80":
        return "pickle"
    if text.lstrip()[:1] in (b"{", b"["):
        return "json"
    if text.split(b"\n", 1)[0].strip() == _RMM_HEADER.encode():
        return "rmm-csv"
    if data.endswith(b"."):
        return "pickle"
    raise _Invalid("unrecognised format (expected a pickle, JSON, or an RMM CSV log)")


def _read(source: str | os.PathLike[str] | bytes, max_bytes: int) -> tuple[str, bytes]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        name, data = "<bytes>", bytes(source)
    else:
        name = os.fsdecode(source)
        try:
            with open(source, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            raise SnapshotError(f"{name}: cannot read: {_one_line(exc)}") from None
    if len(data) > max_bytes:
        raise SnapshotError(f"{name}: larger than the {max_bytes}-byte limit")
    return name, data


def load_snapshot(source: str | os.PathLike[str] | bytes, *, fmt: str | None = None,
                  max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """Load and normalise a snapshot (spec §18.3) from a path or from bytes.

    ``fmt`` is ``"pickle"``, ``"json"``, ``"rmm-csv"`` or None to detect (pickle by its opcode
    magic, JSON by a leading ``{``/``[``, RMM CSV by its header). A top-level list is a
    segments-only snapshot, as ``_memory_viz`` treats it (§18.4). Every segment has device,
    address, total_size, allocated/active/requested_size, stream, segment_type, is_expandable,
    frames and blocks (address, size, requested_size, state, frames); every trace entry has
    exactly action, addr, size, stream, time_us (None when unrecorded), frames, plus
    device_free for ``oom``. Raises `SnapshotError` for anything unreadable or inconsistent.
    """
    if fmt not in (None, "pickle", "json", "rmm-csv"):
        raise ValueError(f"fmt must be None, 'pickle', 'json' or 'rmm-csv', not {fmt!r}")
    name, data = _read(source, max_bytes)
    try:
        if not data:
            raise _Invalid("file is empty")
        kind = fmt or _detect(data)
        if kind == "rmm-csv":
            out = _decode_rmm_csv(data)
        else:
            out = _Walker().snapshot(_decode(kind, data))
    except _Invalid as exc:
        raise SnapshotError(f"{name}: {exc}") from None
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
            entries.append(d)
        traces.append(entries)
    out: dict[str, Any] = {"segments": snap["segments"], "device_traces": traces}
    if snap.get("allocator_settings") is not None:
        out["allocator_settings"] = snap["allocator_settings"]
    return out
