"""Many replays at once: a fleet's snapshots, a tuner's configs — on local cores or a Dask cluster.

A `ReplayJob` names a snapshot file and how to replay it; `run_jobs` runs a list of them and
returns one plain dict per job, in the jobs' order, whatever ran where. Every replay is
deterministic (`vram.replay.engine`), so the results are identical to a serial run: only the
wall time changes.

Engines:
- ``workers=1``: in this process, one job after another.
- local (the default): a `concurrent.futures.ProcessPoolExecutor` with one process per core. The
  replay is pure Python, so threads would share one interpreter lock; processes do not.
- ``cluster="local"`` or ``cluster="tcp://host:8786"``: Dask (``pip install vram[cluster]``).
  Dask rather than Ray: `distributed` is pure Python (Ray ships a large native wheel per platform
  and starts its own object store and raylet), its ``LocalCluster`` starts in a second or two, so
  CI can test it, and its futures are ordinary futures: the same code path as the local pool.
  On a remote cluster every worker must be able to read the snapshot paths (a shared file system).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

#: snapshots kept loaded in a worker between jobs (jobs on one file are sent together)
_CACHE_SIZE = 2
_cache: dict[tuple[str, int, int], dict[str, Any]] = {}


@dataclass(frozen=True)
class ReplayJob:
    """One replay: a snapshot file, its device, and the what-if (see `vram.replay.engine.replay`)."""

    path: str
    device: int = 0
    conf: str | None = None
    gpu: int | str | None = None
    context: int | str = 0
    verify: bool = False
    empty_cache_at: tuple[int, ...] = ()
    cap: int | None = None  # a per-process cap in bytes (``replay(cap=)``)


def load_cached(path: str) -> dict[str, Any]:
    """`load_snapshot`, remembered per worker process (keyed by path, size and mtime)."""
    from vram.replay.loader import load_snapshot

    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    snap = _cache.get(key)
    if snap is None:
        snap = load_snapshot(path)
        while len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[key] = snap
    return snap


def run_job(job: ReplayJob) -> dict[str, Any]:
    """Replay one job; the summary as plain data (``error`` holds a one-line message instead)."""
    from vram.allocator.config import ConfigError
    from vram.replay.engine import replay
    from vram.replay.messages import SnapshotError
    from vram.replay.state import StateError

    out: dict[str, Any] = {"job": asdict(job)}
    try:
        snap = load_cached(job.path)
        result = replay(snap, gpu=job.gpu, context=job.context, conf=job.conf, verify=job.verify,
                        device=job.device, empty_cache_at=job.empty_cache_at, cap=job.cap)
    except (OSError, ValueError, TypeError, SnapshotError, StateError, ConfigError) as exc:
        out["error"] = (str(exc).splitlines() or [type(exc).__name__])[0]
        return out
    out.update(result.to_json())
    out.pop("seconds_replay", None)  # the only figure that differs between runs
    return out


@contextmanager
def _executor(workers: int | None, cluster: str | None) -> Iterator[Executor | None]:
    if cluster is not None:
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise RuntimeError("--cluster needs Dask: pip install 'vram[cluster]'") from None
        if cluster == "local":
            with LocalCluster(n_workers=workers or os.cpu_count() or 1, threads_per_worker=1,
                              processes=True, dashboard_address=None) as lc, Client(lc) as client:
                yield client.get_executor()
        else:
            with Client(cluster) as client:
                yield client.get_executor()
        return
    if workers == 1:
        yield None
        return
    with ProcessPoolExecutor(max_workers=workers) as pool:
        yield pool


def run_jobs(jobs: Sequence[ReplayJob], *, workers: int | None = None, cluster: str | None = None,
             progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Run every job; results in the jobs' order. `workers` None: one per core (1: serially, in
    this process). `cluster`: ``"local"`` for a Dask LocalCluster, or a Dask scheduler address."""
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    if cluster is not None and not (cluster == "local" or "://" in cluster):
        raise ValueError(f"cluster must be 'local' or a Dask scheduler address such as "
                         f"tcp://host:8786, not {cluster!r}")
    total = len(jobs)
    results: list[dict[str, Any]] = []
    if progress is not None:
        progress(0, total)
    with _executor(workers if total > 1 or cluster else 1, cluster) as pool:
        if pool is None:
            for job in jobs:
                results.append(run_job(job))
                if progress is not None:
                    progress(len(results), total)
            return results
        futures: list[Future[dict[str, Any]]] = [pool.submit(run_job, job) for job in jobs]
        for fut in futures:  # in submission order: deterministic
            results.append(fut.result())
            if progress is not None:
                progress(len(results), total)
    return results
