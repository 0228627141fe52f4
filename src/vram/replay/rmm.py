"""RMM's ``logging_resource_adaptor`` allocation log (CSV) as a snapshot: its allocations and
frees as trace entries on device 0 (spec §18.2), for `vram.replay.loader`."""
from __future__ import annotations

import csv
import re
from typing import Any

from .messages import Invalid, int_text, printable
from .validate import RESERVED_STREAMS, stream_error

RMM_HEADER = "Thread,Time,Action,Pointer,Size,Stream"
_NUMBER = re.compile(r"0x[0-9a-f]{1,16}|[0-9]{1,20}")
_CLOCK = re.compile(r"([0-9]{1,2}):([0-9]{2}):([0-9]{2})(?:[.:]([0-9]{1,6}))?")
_EPOCH = re.compile(r"([0-9]{1,12})(?:\.([0-9]{1,6}))?")
_LIMIT = 2**64  # pointers, sizes and streams are 64-bit


def _rmm_number(text: str, path: str) -> int:
    t = text.strip().lower()
    if not _NUMBER.fullmatch(t):
        raise Invalid(f"{path} is not a number ({text[:40]!r})")
    value = int(t, 0 if t.startswith("0x") else 10)
    if value >= _LIMIT:  # as the loader's check of every other integer
        raise Invalid(f"{path} is absurdly large ({int_text(value)} >= {_LIMIT:#x})")
    return value


def _rmm_time(text: str, path: str) -> tuple[int, bool]:
    """(µs, is time of day): ``HH:MM:SS.ffffff`` (spdlog ``%H:%M:%S.%f``; ``:`` before the
    fraction as in RMM's replay parser's doc) or seconds since the epoch (RMM's user guide)."""
    if m := _CLOCK.fullmatch(text.strip()):
        h, mi, s, us = (int(g) for g in (m[1], m[2], m[3], (m[4] or "").ljust(6, "0")))
        return ((h * 60 + mi) * 60 + s) * 10**6 + us, True
    if m := _EPOCH.fullmatch(text.strip()):
        return int(m[1]) * 10**6 + int((m[2] or "").ljust(6, "0")), False
    raise Invalid(f"{path} is not a time ({text[:40]!r})")


def decode_rmm_csv(data: bytes) -> dict[str, Any]:
    """RMM ``logging_resource_adaptor`` log (``Thread,Time,Action,Pointer,Size,Stream``; actions
    allocate / free / allocate failure) as §18.2 entries on device 0: alloc; free_requested +
    free_completed (RMM frees at once); oom with device_free 0 (RMM does not log it)."""
    try:
        lines = data.decode("utf-8-sig").splitlines()
        rows = list(csv.reader(lines[1:]))
    except UnicodeDecodeError as exc:
        raise Invalid(f"unreadable CSV: byte {exc.start:,} is not UTF-8") from None
    except csv.Error as exc:
        raise Invalid(f"unreadable CSV: {printable(str(exc), 100)}") from None
    if not lines or lines[0].strip() != RMM_HEADER:
        raise Invalid(f"not an RMM log: first line is not {RMM_HEADER!r}")
    entries: list[dict[str, Any]] = []
    day, last = 0, -1
    for n, row in enumerate(rows, start=2):
        if not "".join(row).strip():
            continue
        if len(row) != 6:
            raise Invalid(f"line {n} has {len(row)} fields, expected 6")
        _rmm_number(row[0], f"line {n} Thread")
        time_us, of_day = _rmm_time(row[1], f"line {n} Time")
        if of_day:  # time of day only: a backwards jump of more than 12 h is the next day
            day, last = day + (time_us + 43_200 * 10**6 < last), time_us
            time_us += day * 86_400 * 10**6
        action, ptr = row[2].strip(), _rmm_number(row[3], f"line {n} Pointer")
        stream = _rmm_number(row[5], f"line {n} Stream")
        if stream >= RESERVED_STREAMS:
            raise stream_error(f"line {n} Stream", stream)
        common = {"size": _rmm_number(row[4], f"line {n} Size"), "stream": stream, "time_us": time_us}
        if action == "allocate":
            entries.append({"action": "alloc", "addr": ptr, **common, "frames": []})
        elif action in ("free", "deallocate"):
            entries += [{"action": a, "addr": ptr, **common, "frames": []}
                        for a in ("free_requested", "free_completed")]
        elif action == "allocate failure":
            entries.append({"action": "oom", "addr": 0, "device_free": 0, **common,
                            "frames": []})
        else:
            raise Invalid(f"line {n} Action is not allocate/free/allocate failure "
                          f"({action[:40]!r})")
    return {"segments": [], "device_traces": [entries], "allocator_settings": None,
            "legacy": False, "warnings": []}


