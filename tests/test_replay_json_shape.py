"""``vram replay --json`` has one shape for one run and for several (devices or configs): every
run in ``runs``, the first run's fields also at the top (as the one-run output always had)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vram.allocator.caching import CachingAllocator
from vram.allocator.history import ALL
from vram.cli.commands import main
from vram.devices.simulated import SimulatedDevice
from vram.views.snapshot import dump_snapshot, snapshot

MiB = 1 << 20


def recording(path: Path, devices: int) -> str:
    allocs = []
    for d in range(devices):
        a = CachingAllocator(SimulatedDevice("8GiB", index=d), "")
        a.history.configure(True, ALL, 1000, True)
        a.free(a.malloc((d + 1) * 30 * MiB))
        a.malloc(MiB)
        allocs.append(a)
    dump_snapshot(snapshot(allocs), str(path))
    return str(path)


def test_one_device_and_several_give_the_same_shape(tmp_path: Path, capsys: Any) -> None:
    shapes = []
    for devices in (1, 3):
        assert main(["replay", recording(tmp_path / f"{devices}.pickle", devices), "--verify", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert [r["device"] for r in out["runs"]] == list(range(devices))
        assert {k: v for k, v in out.items() if k != "runs"} == out["runs"][0]
        assert [r["peak_reserved"] for r in out["runs"]] == [(d + 1) * 30 * MiB + 2 * MiB for d in range(devices)]
        shapes.append(sorted(out))
    assert shapes[0] == shapes[1]
