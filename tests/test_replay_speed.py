"""What keeps a long replay fast without changing its result: the cyclic GC is paused
while the events run (`vram.replay.safe_pickle.gc_paused`) and restored after, also on errors."""
from __future__ import annotations

import gc
from typing import Any

import pytest

from vram.replay import ccore, loop
from vram.replay.engine import replay

MiB = 1 << 20


def _snap() -> dict[str, Any]:
    trace = [{"action": a, "addr": 0x7F0000000000, "size": MiB, "stream": 0, "time_us": t, "frames": []}
             for t, a in enumerate(("alloc", "free_requested", "free_completed"))]
    return {"segments": [], "device_traces": [trace]}


def test_replay_pauses_the_collector_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ccore.ENV, "0")  # the Python engine's loop (`EventLoop.run`), spied on below
    seen: list[bool] = []
    real = loop.EventLoop.run

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.append(gc.isenabled())
        real(*args, **kwargs)

    monkeypatch.setattr(loop.EventLoop, "run", spy)
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            r = replay(_snap())
            assert (r.events, r.peak_allocated, r.final_allocated) == (3, MiB, 0)
            assert gc.isenabled() is enabled
        monkeypatch.setattr(loop.EventLoop, "run", lambda *a, **k: 1 / 0)
        gc.enable()
        with pytest.raises(ZeroDivisionError):
            replay(_snap())
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]
