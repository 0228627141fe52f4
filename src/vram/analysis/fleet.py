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
from concurrent.futures import BrokenExecutor, Executor, Future, ProcessPoolExecutor
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
    from vram.replay.messages import SnapshotError, printable

    try:
        st = os.stat(path)
    except OSError as exc:
        why = printable(exc.strerror or str(exc), 200)
        raise SnapshotError(f"{printable(path, 300)}: cannot read: {why}") from None
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
    snap = _cache.get(key)
    if snap is None:
        snap = load_snapshot(path)
        while len(_cache) >= _CACHE_SIZE:
            _cache.pop(next(iter(_cache)))
        _cache[key] = snap
    return snap


def devices_of(path: str) -> list[int]:
    """The devices a snapshot records anything on (`vram.replay.engine.recorded_devices`); a file
    that cannot be loaded gets device 0 alone, whose job then reports why in its own row (one
    unreadable file does not stop the fleet)."""
    from vram.replay.engine import recorded_devices
    from vram.replay.messages import SnapshotError

    try:
        return recorded_devices(load_cached(path))
    except (SnapshotError, MemoryError):
        return [0]


def run_job(job: ReplayJob) -> dict[str, Any]:
    """Replay one job; the summary as plain data (``error`` holds a one-line message instead).
    Whatever the job raises is its own row's error: one job never takes the fleet down."""
    from vram.allocator.config import ConfigError
    from vram.devices.base import DriverError
    from vram.replay.engine import replay
    from vram.replay.messages import SnapshotError, printable
    from vram.replay.state import StateError

    out: dict[str, Any] = {"job": asdict(job)}
    name = printable(job.path, 300)
    try:
        snap = load_cached(job.path)  # its errors name the file
    except SnapshotError as exc:
        return error_row(job, str(exc))
    except MemoryError:
        return error_row(job, f"{name}: ran out of memory reading it")
    try:
        result = replay(snap, gpu=job.gpu, context=job.context, conf=job.conf, verify=job.verify,
                        device=job.device, empty_cache_at=job.empty_cache_at, cap=job.cap)
    except (OSError, ValueError, TypeError, SnapshotError, StateError, ConfigError, DriverError) as exc:
        return error_row(job, f"{name}: {(str(exc).splitlines() or [type(exc).__name__])[0]}")
    except MemoryError:
        _cache.clear()
        return error_row(job, f"{name}: ran out of memory replaying it")
    except RecursionError:
        return error_row(job, f"{name}: nested too deeply to replay")
    except Exception as exc:  # a fault of vram's: reported in the job's row, the others kept
        return error_row(job, f"{name}: internal error replaying it: {type(exc).__name__}: "
                              f"{printable(str(exc), 300)}")
    out.update(result.to_json())
    out.pop("seconds_replay", None)  # the only figure that differs between runs
    return out


def error_row(job: ReplayJob, message: str) -> dict[str, Any]:
    """The row of a job that produced no result: the job, and ``error``, one line."""
    return {"job": asdict(job), "error": message}


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


#: what a job whose worker process died (killed, crashed) twice reports: once in the shared pool,
#: once alone in its own process
WORKER_DIED = "its worker process died while replaying it (killed, or crashed), also when run alone"


def _collect(pool: Executor, jobs: Sequence[ReplayJob], todo: Sequence[int],
             finish: Callable[[int, dict[str, Any]], None]) -> list[int]:
    """Run jobs ``todo`` on `pool`, handing each row to `finish`; returns the jobs whose worker
    died (a local pool is then broken: every job not finished by then is returned)."""
    futures: list[Future[dict[str, Any]]] = [pool.submit(run_job, jobs[k]) for k in todo]
    broken = []
    for k, fut in zip(todo, futures):  # in submission order: deterministic
        try:
            row = fut.result()
        except BrokenExecutor:
            broken.append(k)
            continue
        except Exception as exc:  # e.g. Dask's KilledWorker: this job's error, the others kept
            row = error_row(jobs[k], f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        finish(k, row)
    return broken


def run_jobs(jobs: Sequence[ReplayJob], *, workers: int | None = None, cluster: str | None = None,
             progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Run every job; results in the jobs' order. `workers` None: one per core (1: serially, in
    this process). `cluster`: ``"local"`` for a Dask LocalCluster, or a Dask scheduler address.

    Nothing finished is lost: a job that raises is its own row's ``error``; when a local worker
    process dies (killed, out of memory, crashed), the pool breaks and the jobs it had not
    finished are run again (replays are deterministic) in a fresh pool, and if that breaks too,
    each alone in its own process, where one that still kills its worker is reported as
    `WORKER_DIED`."""
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, not {workers}")
    if cluster is not None and not (cluster == "local" or "://" in cluster):
        raise ValueError(f"cluster must be 'local' or a Dask scheduler address such as "
                         f"tcp://host:8786, not {cluster!r}")
    total = len(jobs)
    results: list[dict[str, Any] | None] = [None] * total
    done = 0

    def finish(k: int, row: dict[str, Any]) -> None:
        nonlocal done
        results[k] = row
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    with _executor(workers if total > 1 or cluster else 1, cluster) as pool:
        if pool is None:
            for k, job in enumerate(jobs):
                finish(k, run_job(job))
            return [r for r in results if r is not None]
        broken = _collect(pool, jobs, range(total), finish)
    if broken:  # a worker died: the unfinished jobs once more, then each alone
        with ProcessPoolExecutor(max_workers=workers) as pool:
            broken = _collect(pool, jobs, broken, finish)
        for k in broken:
            with ProcessPoolExecutor(max_workers=1) as pool:
                if _collect(pool, jobs, [k], finish):
                    finish(k, error_row(jobs[k], WORKER_DIED))
    return [r for r in results if r is not None]
