"""``vram tune``: search the allocator's settings for the lowest peak reserved without an OOM.

Every candidate is a ``PYTORCH_CUDA_ALLOC_CONF`` string replayed through the recording(s) on the
same GPU (`vram.replay.engine.replay`); nothing is estimated. The search:

1. the grid of the settings that change where blocks go (spec §3, CUDAAllocatorConfig.cpp):
   ``expandable_segments`` x ``max_split_size_mb`` x ``roundup_power2_divisions``;
2. on a GPU of known size, the few best of those with ``garbage_collection_threshold`` and
   ``per_process_memory_fraction`` (the threshold acts only under a fraction: spec §14,
   ``garbage_collect_cached_blocks`` runs when ``set_fraction`` is true).

Ranked by: no OOM first, then the lowest peak reserved (the highest over a fleet), then fewer
cudaMalloc calls, then the fewer settings. The GPU: ``gpu``/``context`` when given; else, for a
recording with an OOM, the memory PyTorch could have had there: reserved + the recorded
``device_free`` at the first OOM (the rest of the GPU — context, other processes — is taken as
constant over the run); else unlimited. Under the recorded request stream: a program whose
requests depend on the config (it reads ``memory_reserved()`` to pick a batch) is not modelled.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vram.allocator.caching import allocation_size
from vram.allocator.config import parse_alloc_conf
from vram.replay.engine import BUDGET_STEP, smallest_budget

from .fleet import ReplayJob, run_jobs

MAX_SPLIT_MB = (None, 64, 128, 256, 512, 1024)
ROUNDUP_DIVISIONS = (None, 1, 2, 4, 8)
GC_THRESHOLDS = (0.6, 0.8)
FRACTIONS = (0.9, 0.95)
#: base configs carried into the garbage-collection stage
GC_STAGE_BASES = 3


def conf_string(expandable: bool = False, max_split_mb: int | None = None, divisions: int | None = None,
                gc: float | None = None, fraction: float | None = None) -> str:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` text for one candidate ("" is PyTorch's default)."""
    parts = []
    if expandable:
        parts.append("expandable_segments:True")
    if max_split_mb is not None:
        parts.append(f"max_split_size_mb:{max_split_mb}")
    if divisions is not None:
        parts.append(f"roundup_power2_divisions:{divisions}")
    if gc is not None:
        parts.append(f"garbage_collection_threshold:{gc}")
    if fraction is not None:
        parts.append(f"per_process_memory_fraction:{fraction}")
    return ",".join(parts)


def base_grid() -> list[str]:
    """Stage 1: every combination of the placement settings, the default first."""
    return [conf_string(e, m, d) for e, m, d in itertools.product((False, True), MAX_SPLIT_MB, ROUNDUP_DIVISIONS)]


def gc_grid(bases: Sequence[str], fractions: Sequence[float] = FRACTIONS) -> list[str]:
    """Stage 2: each base with a GC threshold under a memory fraction (under a per-process cap
    already, `fractions` empty: the threshold alone)."""
    out = []
    with_fraction: Sequence[float | None] = list(fractions) or [None]
    for base, gc, fraction in itertools.product(bases, GC_THRESHOLDS, with_fraction):
        extra = conf_string(gc=gc, fraction=fraction)
        out.append(f"{base},{extra}" if base else extra)
    return out


@dataclass
class Budget:
    """The GPU a snapshot is tuned on: `gpu` None is unlimited; `why` says where it came from."""

    gpu: int | str | None
    context: int | str
    why: str
    #: a per-process cap in bytes instead of a GPU size (on a device with room): `cap_bound`
    cap: int | None = None


@dataclass
class TuneResult:
    """Every config tried, ranked; `best` is the first."""

    snapshots: list[str]
    budgets: list[Budget]
    results: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: candidates that could not be replayed: ``{"conf", "error"}``, not ranked
    failed: list[dict[str, Any]] = field(default_factory=list)

    #: where no config fits: the least demanding config found and the smallest budget it fits in
    #: (``{"conf", "gpu", "more"}``, checked by replay; one snapshot on a known GPU), else None
    least_demanding: dict[str, Any] | None = None

    @property
    def best(self) -> dict[str, Any] | None:
        """The first config without an OOM; None when every config runs out of memory."""
        return self.results[0] if self.results and not self.results[0]["oom"] else None

    def __str__(self) -> str:
        from .report import tune_text

        return tune_text(self)

    def __repr__(self) -> str:
        from .report import tune_repr

        return tune_repr(self)

    def _repr_html_(self) -> str:
        from .report import tune_html

        return tune_html(self)

    def to_json(self) -> dict[str, Any]:
        return {"best": self.best, "least_demanding": self.least_demanding, "results": self.results,
                "notes": self.notes, "failed": self.failed,
                "snapshots": [{"path": p, "gpu": b.gpu, "context": b.context, "gpu_from": b.why}
                              for p, b in zip(self.snapshots, self.budgets)]}


def cap_bound(oom: dict[str, Any], large_segment_size: int = 20971520) -> int | None:
    """At a recorded OOM, the most a per-process cap can have allowed, or None where the device
    itself was full.

    ``alloc_block`` (CUDACachingAllocator.cpp) fails either on the cap, ``total_allocated_memory
    + alloc_size > allowed_memory_maximum`` (``set_per_process_memory_fraction``), or on
    ``cudaMalloc``, which fails only with less than ``alloc_size`` free on the device. The OOM
    entry records the device's free memory after the retry: with at least ``alloc_size`` free,
    only a cap can have refused, and it was below reserved + ``alloc_size``."""
    need = allocation_size(oom["size"], large_segment_size)
    if oom["device_free"] < need:
        return None
    return oom["reserved"] + need - 1


def budgets_for(probes: Sequence[dict[str, Any]], gpu: int | str | None, context: int | str,
                cap: int | None = None) -> list[Budget]:
    """The GPU for each snapshot, from the user (a GPU, or a per-process `cap`) or from its
    recorded OOM (see module doc): under a per-process cap (`cap_bound`), the cap's upper end."""
    out = []
    for probe in probes:
        oom = probe.get("oom")
        if cap is not None:
            out.append(Budget(None, 0, "a per-process cap, given", cap))
        elif gpu is not None:
            out.append(Budget(gpu, context, "given"))
        elif oom is not None and oom.get("recorded") and (cap := cap_bound(
                oom, parse_alloc_conf(probe["conf"]).large_segment_size)) is not None:
            out.append(Budget(None, 0, f"recorded OOM at event {oom['event_index']} with "
                                       f"{oom['device_free']:,} B of the device free: a per-process cap, "
                                       f"at most {cap:,} B (reserved + the segment requested, less 1)", cap))
        elif oom is not None and oom.get("recorded"):
            out.append(Budget(oom["reserved"] + oom["device_free"], 0,
                              f"recorded OOM at event {oom['event_index']}: reserved + free there"))
        else:
            out.append(Budget(None, 0, "unlimited (no OOM recorded, no --gpu)"))
    return out


def _rank_key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["oom"], row["peak_reserved"], row["segment_allocs"], row["conf"].count(",") + bool(row["conf"]),
            row["conf"])


def _rows(confs: Sequence[str], paths: Sequence[str], devices: Sequence[int], budgets: Sequence[Budget],
          workers: int | None, cluster: str | None, progress: Callable[[int, int], None] | None,
          failed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One ranked row per config that replayed on every snapshot; the others go to `failed` (one
    candidate that cannot be replayed does not stop the search)."""
    jobs = [ReplayJob(p, d, conf, b.gpu, b.context, cap=b.cap)
            for conf in confs for p, d, b in zip(paths, devices, budgets)]
    out = run_jobs(jobs, workers=workers, cluster=cluster, progress=progress)
    rows = []
    n = len(paths)
    for k, conf in enumerate(confs):
        runs = out[k * n:(k + 1) * n]
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            failed.append({"conf": conf, "error": errors[0]})
            continue
        rows.append({
            "conf": conf,
            "peak_reserved": max(r["peak_reserved"] for r in runs),
            "oom": any(r["ooms"] > 0 for r in runs),
            "ooms": sum(r["ooms"] for r in runs),
            "peak_allocated": max(r["peak_allocated"] for r in runs),
            "segment_allocs": sum(r["segment_allocs"] for r in runs),
            "per_snapshot": [{"peak_reserved": r["peak_reserved"], "ooms": r["ooms"],
                              "first_oom_event": r["oom"]["event_index"] if r["oom"] else None} for r in runs],
        })
    return rows


def tune(paths: Sequence[str], *, gpu: int | str | None = None, context: int | str = 0,
         devices: Sequence[int] | None = None, workers: int | None = None, cluster: str | None = None,
         progress: Callable[[int, int], None] | None = None, cap: int | None = None) -> TuneResult:
    """Tune one recording or a fleet of them (one config for all); see the module doc. `cap`: a
    per-process cap in bytes to tune under, instead of a GPU."""
    if not paths:
        raise ValueError("no snapshot to tune")
    devs = list(devices) if devices is not None else [0] * len(paths)
    probes = run_jobs([ReplayJob(p, d) for p, d in zip(paths, devs)], workers=workers, cluster=cluster)
    unread = [probe["error"] for probe in probes if "error" in probe]  # each names its file
    if len(unread) == len(probes):
        raise ValueError(unread[0])
    kept = [k for k, probe in enumerate(probes) if "error" not in probe]
    paths, devs, probes = [paths[k] for k in kept], [devs[k] for k in kept], [probes[k] for k in kept]
    budgets = budgets_for(probes, gpu, context, cap)
    result = TuneResult(list(paths), budgets)
    result.notes += [f"not tuned: {e}" for e in unread]
    grid = base_grid()
    recorded = sorted({probe["conf"] for probe in probes} - set(grid))
    rows = _rows(recorded + grid, paths, devs, budgets, workers, cluster, progress, result.failed)
    if all(b.gpu is not None or b.cap is not None for b in budgets) and rows:
        bases = [r["conf"] for r in sorted(rows, key=_rank_key)[:GC_STAGE_BASES]]
        capped = any(b.cap is not None for b in budgets)  # the cap is the fraction: only the threshold
        rows += _rows(gc_grid(bases, () if capped else FRACTIONS), paths, devs, budgets, workers, cluster, progress,
                      result.failed)
    else:
        result.notes.append("garbage_collection_threshold and per_process_memory_fraction not searched: "
                            "they act against the GPU's size, and it is unlimited here (pass --gpu)")
    if not rows:
        raise ValueError(f"no config could be replayed: {result.failed[0]['conf'] or '(default)'}: "
                         f"{result.failed[0]['error']}")
    if result.failed:
        first = result.failed[0]
        result.notes.append(f"{len(result.failed)} config(s) could not be replayed and are not ranked "
                            f"(first: {first['conf'] or '(default)'}: {first['error']})")
    for k, (p, probe, b) in enumerate(zip(paths, probes, budgets)):
        oom = probe.get("oom")
        row = next((r for r in rows if r["conf"] == probe["conf"]), None)
        if oom is not None and oom.get("recorded") and gpu is None and row is not None:
            if row["per_snapshot"][k]["first_oom_event"] != oom["event_index"]:
                on = f"a cap of {b.cap:,} B" if b.cap is not None else f"{b.gpu:,} B"
                result.notes.append(f"{p}: on {on} the recorded config does not fail at the "
                                    f"recorded OOM (event {oom['event_index']}): the GPU's other memory "
                                    "changed during the run, or the failure was not for lack of bytes")
    rows.sort(key=_rank_key)
    result.results = rows
    if rows and rows[0]["oom"] and len(paths) == 1 and (isinstance(budgets[0].gpu, int) or budgets[0].cap):
        result.least_demanding = _least_demanding(rows, paths[0], devs[0], budgets[0])
        if result.least_demanding is not None:
            result.least_demanding["lower_bound"] = ends_at_oom(paths[0], devs[0], probes[0].get("oom"))
    return result


#: configs bisected for the smallest budget each fits in, when none fits
LEAST_DEMANDING_TRIES = 3
#: replays spent bisecting one budget
BISECTIONS = 10


def smallest_fit(path: str, device: int, conf: str, low: int, high: int, context: int | str = 0,
                 as_cap: bool = False) -> int | None:
    """The smallest budget (bytes for PyTorch, 2 MiB steps, at most ``BISECTIONS`` replays) in
    (low, high] where `conf` replays `path` without an OOM; None if it does not fit in `high`.
    The budget is a GPU's size, or with `as_cap` a per-process cap on a GPU with room."""
    def fits(gpu: int) -> bool:
        job = ReplayJob(path, device, conf, None, context, cap=gpu) if as_cap else ReplayJob(path, device, conf, gpu,
                                                                                              context)
        r = run_jobs([job], workers=1)[0]
        return "error" not in r and r["ooms"] == 0

    return smallest_budget(fits, low, high, BISECTIONS)


def ends_at_oom(path: str, device: int, oom: dict[str, Any] | None) -> bool:
    """Whether the recording stops at its recorded OOM (no allocation after it): then a budget
    that fits it is only enough for what was recorded, a lower bound for the program."""
    if oom is None or not oom.get("recorded"):
        return False
    from .fleet import load_cached

    trace = load_cached(path)["device_traces"][device]
    return not any(e["action"] == "alloc" for e in trace[oom["event_index"] + 1:])


def fit_bound(peak: int, budget: int, as_cap: bool) -> int:
    """A budget the run certainly fits in, given its peak reserved on a GPU without limit: that
    peak on a GPU; under a cap, which ``alloc_block`` checks against reserved + the whole new
    segment, the peak plus the largest segment (a segment is at most the peak + 20 MiB)."""
    return max(2 * peak + 20 * 2**20 if as_cap else peak, budget + BUDGET_STEP)


def _least_demanding(rows: Sequence[dict[str, Any]], path: str, device: int, budget: Budget) -> dict[str, Any] | None:
    """Where every config runs out of memory on `budget`: of the configs that fail latest (the
    default among them), the one that fits in the least memory, and that memory (bisected, each
    step a replay). Its need on a GPU without limit bounds the search."""
    gpu = budget.cap if budget.cap is not None else budget.gpu
    assert isinstance(gpu, int)
    latest = sorted(rows, key=lambda r: (-(r["per_snapshot"][0]["first_oom_event"] or 0), r["peak_reserved"]))
    tries = [r["conf"] for r in latest[:LEAST_DEMANDING_TRIES]]
    tries += [] if "" in tries else [""]
    best: dict[str, Any] | None = None
    for conf in tries:
        free = run_jobs([ReplayJob(path, device, conf)], workers=1)[0]
        if "error" in free:
            continue
        need = smallest_fit(path, device, conf, gpu, fit_bound(free["peak_reserved"], gpu, budget.cap is not None),
                            budget.context, as_cap=budget.cap is not None)
        if need is not None and need > gpu and (best is None or need < best["gpu"]):
            best = {"conf": conf, "gpu": need, "more": need - gpu}
    return best
