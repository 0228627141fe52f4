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


def gc_grid(bases: Sequence[str]) -> list[str]:
    """Stage 2: each base with a GC threshold under a memory fraction."""
    out = []
    for base, gc, fraction in itertools.product(bases, GC_THRESHOLDS, FRACTIONS):
        extra = conf_string(gc=gc, fraction=fraction)
        out.append(f"{base},{extra}" if base else extra)
    return out


@dataclass
class Budget:
    """The GPU a snapshot is tuned on: `gpu` None is unlimited; `why` says where it came from."""

    gpu: int | str | None
    context: int | str
    why: str


@dataclass
class TuneResult:
    """Every config tried, ranked; `best` is the first."""

    snapshots: list[str]
    budgets: list[Budget]
    results: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> dict[str, Any]:
        return self.results[0]

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
        return {"best": self.best, "results": self.results, "notes": self.notes,
                "snapshots": [{"path": p, "gpu": b.gpu, "context": b.context, "gpu_from": b.why}
                              for p, b in zip(self.snapshots, self.budgets)]}


def budgets_for(probes: Sequence[dict[str, Any]], gpu: int | str | None, context: int | str) -> list[Budget]:
    """The GPU for each snapshot, from the user or from its recorded OOM (see module doc)."""
    out = []
    for probe in probes:
        oom = probe.get("oom")
        if gpu is not None:
            out.append(Budget(gpu, context, "given"))
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
          workers: int | None, cluster: str | None,
          progress: Callable[[int, int], None] | None) -> list[dict[str, Any]]:
    jobs = [ReplayJob(p, d, conf, b.gpu, b.context) for conf in confs for p, d, b in zip(paths, devices, budgets)]
    out = run_jobs(jobs, workers=workers, cluster=cluster, progress=progress)
    rows = []
    n = len(paths)
    for k, conf in enumerate(confs):
        runs = out[k * n:(k + 1) * n]
        errors = [r["error"] for r in runs if "error" in r]
        if errors:
            raise ValueError(f"config {conf!r}: {errors[0]}")
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
         progress: Callable[[int, int], None] | None = None) -> TuneResult:
    """Tune one recording or a fleet of them (one config for all); see the module doc."""
    if not paths:
        raise ValueError("no snapshot to tune")
    devs = list(devices) if devices is not None else [0] * len(paths)
    probes = run_jobs([ReplayJob(p, d) for p, d in zip(paths, devs)], workers=workers, cluster=cluster)
    for p, probe in zip(paths, probes):
        if "error" in probe:
            raise ValueError(f"{p}: {probe['error']}")
    budgets = budgets_for(probes, gpu, context)
    result = TuneResult(list(paths), budgets)
    grid = base_grid()
    recorded = sorted({probe["conf"] for probe in probes} - set(grid))
    rows = _rows(recorded + grid, paths, devs, budgets, workers, cluster, progress)
    if all(b.gpu is not None for b in budgets):
        bases = [r["conf"] for r in sorted(rows, key=_rank_key)[:GC_STAGE_BASES]]
        rows += _rows(gc_grid(bases), paths, devs, budgets, workers, cluster, progress)
    else:
        result.notes.append("garbage_collection_threshold and per_process_memory_fraction not searched: "
                            "they act against the GPU's size, and it is unlimited here (pass --gpu)")
    for p, probe, b in zip(paths, probes, budgets):
        oom = probe.get("oom")
        if oom is not None and oom.get("recorded") and gpu is None:
            row = next(r for r in rows if r["conf"] == probe["conf"])
            k = list(paths).index(p)
            if row["per_snapshot"][k]["first_oom_event"] != oom["event_index"]:
                result.notes.append(f"{p}: on {b.gpu:,} B the recorded config does not fail at the "
                                    f"recorded OOM (event {oom['event_index']}): the GPU's other memory "
                                    "changed during the run, or the failure was not for lack of bytes")
    rows.sort(key=_rank_key)
    result.results = rows
    return result

