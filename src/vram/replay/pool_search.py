"""Memory pools of a recording without trace pool ids, found by replay (spec §5, §11.1).

PyTorch releases before ``TraceEntry`` carried its pool (``mempool_``) write no ``pool_id`` on
trace entries; only the segments alive at the end say their pool (``segment_pool_id``). The
pool of a segment freed in the trace, and of an ``oom`` entry, is then not in the file
(`vram.replay.pool_replay.Unknown`). It is searched for, soundly:

* a *labelling* gives each unknown a pool: the default pool, a private pool of the final segments,
  or an unrecorded private pool (one seen nowhere else: ``FRESH`` ids, numbered in order of first
  use so that renamings are not tried twice);
* each candidate is checked by replay with verification: depth-first in trace order, a partial
  labelling is replayed up to the next unknown's first event (`Unknown.first`: no event before it
  depends on a pool not yet chosen, and the replay is deterministic) and dropped at the first
  event that differs from the recording (an ``alloc`` address, an ``oom`` that succeeds, a
  ``segment_alloc`` / ``segment_free`` / map / unmap); a complete one must reproduce the whole
  recording, final segments and blocks included;
* a labelling is used only if it is the only one that verifies, or if every one that verifies
  gives the same result for the question asked (`agree`); else the replay is refused in one line
  naming the ambiguity. None verifying is refused too.

Bounds: at most ``MAX_REPLAYS`` (256) verifying replays per search, and at most ``MAX_LABELLINGS``
(8) labellings kept; beyond either the recording is refused (a search of that size is cheaper
done by recording with a PyTorch that writes trace pool ids). Each replay is linear in the trace.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vram.views.snapshot import segments as snapshot_segments

from .messages import SnapshotError
from .pool_replay import Unknown, pools_by_address
from .validate import DEFAULT_POOL, private_pool

MAX_REPLAYS = 256
MAX_LABELLINGS = 8
#: ids of unrecorded private pools: (FRESH + k, 0) for the k-th, above any id PyTorch hands out soon
FRESH = 1 << 62
_POOLED = frozenset(("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                     "segment_map", "segment_unmap", "oom"))
_COUNTS = ("segment_allocs", "segment_frees", "segment_maps", "segment_unmaps", "alloc_addresses",
           "recorded_ooms", "final_segments", "final_blocks")
#: (id(trace), device) -> (trace, labellings, complete)
_CACHE: dict[tuple[int, int], tuple[Sequence[Any], list[list[Any]], bool]] = {}

Pool = tuple[int, int] | None
Replay = Callable[..., Any]


def to_infer(final: Sequence[Mapping[str, Any]], trace: Sequence[Mapping[str, Any]], device: int,
             first_pool_id: int | None) -> tuple[list[Pool], list[Unknown]] | None:
    """(per entry its known pool, the unknowns) when `trace` has no ``pool_id`` on any entry, the
    final segments show private pools, and some segment freed in the trace or ``oom`` entry has a
    pool the file does not say; else None. `first_pool_id` as for `plan_pools` (0: not known)."""
    if first_pool_id is not None and any("pool_id" in e for e in itertools.islice(trace, first_pool_id, None)):
        return None
    if not any(private_pool(s.get("segment_pool_id")) for s in final):
        return None
    pools, units = pools_by_address(final, trace, device)
    return (pools, units) if units else None


def labelled(snapshot: Mapping[str, Any], device: int, pools: Sequence[Pool], units: Sequence[Unknown],
             labels: Sequence[Pool]) -> dict[str, Any]:
    """`snapshot` with ``pool_id`` written on every entry of `device`'s trace: the known pools,
    `labels` for the first unknowns and the default pool for the rest."""
    ids = list(pools)
    for unit, label in zip(units, labels):
        for i in unit.entries:
            ids[i] = label
    trace = snapshot["device_traces"][device]
    out = [{**e, "pool_id": ids[i] or DEFAULT_POOL} if e["action"] in _POOLED else e for i, e in enumerate(trace)]
    traces = list(snapshot["device_traces"])
    traces[device] = out
    return {**snapshot, "device_traces": traces}


class Labellings:
    """The labellings found for a trace: `labels` (per unit, in `units` order), `snapshots` (the
    recording labelled each way), and whether the search saw them all (`complete`)."""

    __slots__ = ("labels", "snapshots", "units", "complete", "trace")

    def __init__(self, labels: list[list[Pool]], snapshots: list[dict[str, Any]], units: Sequence[Unknown],
                 complete: bool, trace: Sequence[Mapping[str, Any]]) -> None:
        self.labels, self.snapshots, self.units, self.complete, self.trace = labels, snapshots, units, complete, trace

    def settling(self, a: int = 0, b: int | None = None) -> str:
        """The one fact the file lacks that tells labellings `a` and `b` apart (any two found when
        `b` is None): the pool of the earliest unit they label differently."""
        others = [b] if b is not None else range(len(self.labels))
        diff = [u for u in range(len(self.units)) if any(self.labels[a][u] != self.labels[o][u] for o in others)]
        if not diff:
            return "nothing in the file"
        u = min(diff, key=lambda k: self.units[k].first)
        return describe(self.units[u], self.trace) + (f" (and {len(diff) - 1} more such)" if len(diff) > 1 else "")


def describe(unit: Unknown, trace: Sequence[Mapping[str, Any]]) -> str:
    """Which pool `unit` was in, in words: the question whose answer would settle it."""
    first = trace[unit.entries[0]]
    if unit.kind == "oom":
        return f"which pool the failed request of {first['size']} bytes at event {unit.entries[0]} was for"
    alloc = next((i for i in unit.entries if trace[i]["action"] in ("segment_alloc", "segment_map")), None)
    freed = next((i for i in unit.entries if trace[i]["action"] in ("segment_free", "segment_unmap")), None)
    when = (f"allocated at event {alloc}" if alloc is not None else "allocated before the trace") + (
        f", freed at event {freed}" if freed is not None else "")
    base = next((trace[i]["addr"] for i in (alloc, freed) if i is not None), None)
    where = f"at {base:#x}" if base is not None else f"holding {first['addr']:#x}"
    return f"which pool the segment {where} ({when}) belonged to: the default pool or a private one"


def labellings(snapshot: Mapping[str, Any], device: int, found: tuple[list[Pool], list[Unknown]],
               replay: Replay) -> Labellings:
    """`snapshot` labelled in ways that reproduce it (see the module doc); cached per trace."""
    trace = snapshot["device_traces"][device]
    key = (id(trace), device)
    hit = _CACHE.get(key)
    pools, units = found
    if hit is None or hit[0] is not trace:
        hit = (trace, *_search(snapshot, device, pools, units, replay))
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = hit
    return Labellings(hit[1], [labelled(snapshot, device, pools, units, labels) for labels in hit[1]], units,
                      hit[2], trace)


class _Enough(Exception):
    """The search has found more labellings than it keeps, or spent its replays after one."""


def _search(snapshot: Mapping[str, Any], device: int, pools: Sequence[Pool], units: Sequence[Unknown],
            replay: Replay) -> tuple[list[list[Pool]], bool]:
    """The labellings that reproduce the recording (in `units` order), and whether they are all
    of them: the search stops at ``MAX_LABELLINGS`` + 1 found, or at ``MAX_REPLAYS`` once one is."""
    trace = snapshot["device_traces"][device]
    final = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]
    known = sorted({p for p in (private_pool(s.get("segment_pool_id")) for s in final) if p is not None})
    order = sorted(range(len(units)), key=lambda u: units[u].first)
    units = [units[u] for u in order]
    found: list[list[Pool]] = []
    replays = 0
    what = (f"device_traces[{device}]: a recording without trace pool ids (older PyTorch) with "
            f"{sum(u.kind == 'segment' for u in units)} segments freed in the trace and "
            f"{sum(u.kind == 'oom' for u in units)} oom entries of unrecorded pool")

    def check(labels: list[Pool], stop: int | None) -> bool:
        nonlocal replays
        replays += 1
        if replays > MAX_REPLAYS:
            if found:
                raise _Enough
            raise SnapshotError(f"{what}: finding their pools needs more than {MAX_REPLAYS} verifying replays "
                                "(record with a PyTorch that writes pool_id on trace entries)")
        r = replay(labelled(snapshot, device, pools, units, labels), verify=True, device=device,
                   stop_at=stop, skip_cycles=False)
        return _exact(r.verification) if stop is None else _prefix_ok(r, trace, stop)

    def walk(labels: list[Pool], fresh: int) -> None:
        j = len(labels)
        if j == len(units):
            if check(labels, None):
                found.append(labels)
                if len(found) > MAX_LABELLINGS:
                    raise _Enough
            return
        for label in [None, *known, *((FRESH + k, 0) for k in range(fresh + 1))]:
            more = labels + [label]
            nxt = units[j + 1].first if j + 1 < len(units) else None
            if nxt is not None and nxt > units[j].first and not check(more, nxt):
                continue  # the events before the next unknown differ from the recording
            walk(more, fresh + (label == (FRESH + fresh, 0)))

    try:
        walk([], 0)
        complete = True
    except _Enough:
        complete = False
    if not found:
        raise SnapshotError(f"{what}: no assignment of pools to them reproduces the recording exactly, "
                            "so it is not replayed")
    inverse = sorted(range(len(order)), key=lambda u: order[u])
    return [[labels[k] for k in inverse] for labels in found], complete


def _exact(v: Mapping[str, Any]) -> bool:
    return all(v[k]["matched"] == v[k]["total"] for k in _COUNTS) and not v["divergences"]


def _prefix_ok(r: Any, trace: Sequence[Mapping[str, Any]], stop: int) -> bool:
    """Every event before `stop` reproduced: alloc addresses, recorded OOMs, and the driver calls
    (cudaMalloc / cudaFree / map / unmap: address, size, order) recorded before it, no more."""
    v = r.verification
    if any(v[k]["matched"] != v[k]["total"] for k in ("alloc_addresses", "recorded_ooms")):
        return False
    if any(not d["kind"].startswith("final_") for d in v["divergences"]):
        return False
    dev = r.allocator.device

    def want(action: str) -> list[tuple[int, int]]:
        return [(e["addr"], e["size"]) for e in itertools.islice(trace, stop) if e["action"] == action]

    return ([(a, s) for a, s, _ in dev.mallocs] == want("segment_alloc") and list(dev.frees) == want("segment_free")
            and list(dev.maps) == want("segment_map") and list(dev.unmaps) == want("segment_unmap"))


#: a figure that depends on which pool free memory belongs to, not on any event: exact labellings
#: may differ in it (the default pools' largest free block), so it is withheld, not refused
_POOL_FIGURES = ("largest_free_block_at_reserved_peak",)


def decide(found: Labellings, run: Callable[..., Any], device: int, what_if: bool) -> Any:
    """The replay answer every labelling gives, else a refusal naming the fact that would settle it.

    Every labelling found reproduces the recording event for event (the search checks it), so
    under the recorded config on a GPU of unknown size they all give the same replay: it verifies
    (said in a note), and only a figure that depends on which pool memory is in
    (``_POOL_FIGURES``) may differ: it is then withheld (None) with the reason. A what-if (another
    config or GPU, added ``empty_cache`` calls) is answered only when every labelling is known and
    gives the same answer."""
    where = f"device_traces[{device}]: a recording without trace pool ids"
    if what_if and not found.complete:
        raise SnapshotError(f"{where}: more than {MAX_LABELLINGS} assignments of pools reproduce it exactly, and "
                            f"this what-if may differ between them: {found.settling()} would settle it "
                            "(record with a PyTorch that writes pool_id on trace entries); not replayed")
    results = [run(s) for s in (found.snapshots if what_if or found.complete else found.snapshots[:1])]
    first, withheld = _outcome(results[0]), []
    for k, r in enumerate(results[1:], 1):
        other = _outcome(r)
        for key in first:
            if first[key] == other.get(key) or key in withheld:
                continue
            if what_if or key not in _POOL_FIGURES:
                raise SnapshotError(f"{where}: {len(results)} assignments of pools to its freed segments and oom "
                                    f"entries reproduce it exactly but give different {key} here "
                                    f"({_brief(first[key])} vs {_brief(other[key])}): "
                                    f"{found.settling(0, k)} would settle it; ambiguous, not replayed")
            withheld.append(key)
            setattr(results[0], key, None)
            _note(results[0], f"{key} not given: it is {_brief(first[key])} or {_brief(other[key])} "
                              f"depending on {found.settling(0, k)}")
    if not what_if and not found.complete and not _largest_free_is_settled(found, run, results[0]):
        for key in _POOL_FIGURES:
            setattr(results[0], key, None)
            _note(results[0], f"{key} not given: it depends on {found.settling()}, which the file does not say")
    count = f"{len(found.labels)}" if found.complete else f"more than {MAX_LABELLINGS}"
    _note(results[0], f"the pools of {len(found.units)} segments freed in the trace or oom entries are not in "
                      f"the file (no pool_id on trace entries); {count} assignments of pools reproduce it event "
                      "for event, so the replay under the recorded config is the same for each")
    return results[0]


def _largest_free_is_settled(found: Labellings, run: Callable[..., Any], result: Any) -> bool:
    """Whether the default pools' largest free block at the reserved peak is the same under every
    labelling: no free block of a segment whose pool the file lacks is larger than the largest
    free block of the segments it says are the default pool's (then that one is the answer)."""
    if result.reserved_peak_event < 0:
        return True
    ranges = [(found.trace[i]["addr"], found.trace[i]["addr"] + found.trace[i]["size"])
              for u in found.units if u.kind == "segment" for i in u.entries
              if found.trace[i]["action"] in ("segment_alloc", "segment_free", "segment_map", "segment_unmap")]
    at_peak = run(found.snapshots[0], stop_at=result.reserved_peak_event + 1, verify=False)
    known = unknown = 0
    for seg in snapshot_segments(at_peak.allocator):
        free = max((b["size"] for b in seg["blocks"] if b["state"] == "inactive"), default=0)
        if any(lo <= seg["address"] < hi for lo, hi in ranges):
            unknown = max(unknown, free)
        elif not private_pool(seg.get("segment_pool_id")):
            known = max(known, free)
    return unknown <= known and known == result.largest_free_block_at_reserved_peak


def _note(result: Any, text: str) -> None:
    result.caveats.append(text)


def _outcome(r: Any) -> dict[str, Any]:
    """What a replay answers, bar its timing and the names of unrecorded pools."""
    out = {k: v for k, v in r.to_json().items() if k not in ("seconds_replay", "caveats")}
    out["segments"] = [(s["address"], s["total_size"], _pool_name(s.get("segment_pool_id")),
                        [(b["size"], b["state"], b.get("requested_size", 0)) for b in s["blocks"]])
                       for s in snapshot_segments(r.allocator)]
    return out


def _pool_name(pid: Any) -> Any:
    return "unrecorded" if pid is not None and pid[0] >= FRESH else pid


def _brief(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
