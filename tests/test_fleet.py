"""Many replays at once (`vram.analysis.fleet`): local processes and a Dask LocalCluster give
exactly the serial results, in the jobs' order."""
from __future__ import annotations

from pathlib import Path

import pytest

from paths import RECORDINGS as TRACES  # noqa: E402
from vram.analysis.fleet import ReplayJob, run_jobs


def _jobs() -> list[ReplayJob]:
    files = ["cs336-s-mem", "cs336-s-forward-bf16-128", "llm-inference-oom-state"]
    jobs = [ReplayJob(str(TRACES / f"{f}.pickle"), conf=c, gpu=g)
            for f in files for c in (None, "expandable_segments:True") for g in (None, "3GiB")]
    jobs.append(ReplayJob(str(TRACES / "cs336-s-mem.pickle"), device=3))  # an error, in its place
    return jobs


def test_local_processes_equal_serial():
    jobs = _jobs()
    serial = run_jobs(jobs, workers=1)
    assert run_jobs(jobs, workers=2) == serial
    assert [r["job"]["path"] for r in serial] == [j.path for j in jobs]
    assert "device 3 is not in the snapshot" in serial[-1]["error"]
    # the 3.5 GiB recording does not fit in 3 GiB; the 822 MiB one does
    by = {(Path(r["job"]["path"]).stem, r["job"]["conf"], r["job"]["gpu"]): r for r in serial[:-1]}
    assert by[("cs336-s-mem", None, "3GiB")]["ooms"] > 0
    assert by[("cs336-s-forward-bf16-128", None, "3GiB")]["ooms"] == 0


def test_dask_local_cluster_equals_serial():
    pytest.importorskip("distributed")
    jobs = _jobs()
    assert run_jobs(jobs, workers=2, cluster="local") == run_jobs(jobs, workers=1)


def test_bad_cluster_and_workers_are_refused():
    with pytest.raises(ValueError, match="cluster must be"):
        run_jobs(_jobs(), cluster="nowhere")
    with pytest.raises(ValueError, match="workers must be"):
        run_jobs(_jobs(), workers=0)
