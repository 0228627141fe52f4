"""What the kernel tests share: the allocator events a piece of a program makes on the simulated GPU."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def allocator_events(run: Callable[[], Any], actions: Iterable[str] = ("alloc", "free_completed"),
                     short: bool = False, stop: bool = False) -> list[tuple[str, int]]:
    """(action, size) of each trace event among `actions` recorded on device 0 by the end of
    `run()`, memory history turned on at its start (events recorded before stay in the trace);
    `stop`: history off afterwards; `short`: the action's first letter ("a", "f")."""
    import torch

    wanted = tuple(actions)
    torch.cuda.memory._record_memory_history()
    run()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    if stop:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [(e["action"][0] if short else e["action"], e["size"]) for e in trace if e["action"] in wanted]
