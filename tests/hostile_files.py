"""Building hostile snapshot files in tests: pickles opcode by opcode, segments
and trace entries in PyTorch's snapshot shape (spec §18.2, §18.3), and running code in a
subprocess so that a crash fails a test instead of killing pytest."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paths import RECORDINGS
from vram.replay.loader import SnapshotError, load_snapshot

MiB = 1 << 20
SRC = Path(__file__).resolve().parents[1] / "src"
TRACES = RECORDINGS
BASE = 0x7F00_0000_0000


def short_str(text: str) -> bytes:
    b = text.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def snapshot_opcodes(settings: bytes = b"", entries: bytes = b"") -> bytes:
    """``{"segments": [], "device_traces": [[<entries>]], "allocator_settings": {<settings>}}``
    as protocol-4 opcodes; the caller supplies raw opcodes for the items."""
    out = b"\x80\x04}(" + short_str("segments") + b"]" + short_str("device_traces") + b"](]"
    if entries:
        out += b"(" + entries + b"e"
    out += b"e"
    if settings:
        out += short_str("allocator_settings") + b"}(" + settings + b"u"
    return out + b"u."


def deep_tuple(depth: int) -> bytes:
    return b"K\x01" + b"\x85" * depth  # BININT1 1, then TUPLE1 once per level


def entry(action: str = "alloc", addr: int = BASE, size: int = 512, t: int = 0, **kw: Any) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": [], **kw}


def segment(address: int, blocks: list[tuple[int, str, int]], **kw: Any) -> dict[str, Any]:
    """A segment from (size, state, requested_size) blocks, sums derived (spec §18.3)."""
    out, addr = [], address
    for size, state, req in blocks:
        out.append({"address": addr, "size": size, "requested_size": req, "state": state, "frames": []})
        addr += size
    total = addr - address
    return {"device": 0, "address": address, "total_size": total,
            "allocated_size": sum(s for s, st, _ in blocks if st == "active_allocated"),
            "active_size": sum(s for s, st, _ in blocks if st != "inactive"),
            "requested_size": sum(r for _, st, r in blocks if st != "inactive"), "stream": 0,
            "segment_type": "small" if total == 2 * MiB else "large", "is_expandable": False,
            "frames": [], "blocks": out, **kw}


def snap(segments: list[Any] | None = None, trace: list[Any] | None = None, **kw: Any) -> bytes:
    return pickle.dumps({"segments": segments or [], "device_traces": [trace or []], **kw})


def reject(data: bytes, *needles: str, **kw: Any) -> str:
    with pytest.raises(SnapshotError) as info:
        load_snapshot(data, **kw)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("<bytes>: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


def run_python(code: str, *args: str, limit_as: int | None = None) -> subprocess.CompletedProcess[str]:
    def cap() -> None:
        if limit_as is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=60, preexec_fn=cap)
