"""Where the tests find the real recordings and the programs behind them.

The recordings are carried in the repository (``recordings/``, see its README), so a fresh clone
verifies them; ``VRAM_TRACES`` points the tests at another folder of the same files. The programs
that made three of them are other people's code under no stated licence: they are read from
``../shared/programs`` (or ``VRAM_PROGRAMS``) and the tests that run them skip without it.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDINGS = Path(os.environ.get("VRAM_TRACES", REPO / "recordings"))
PROGRAMS = Path(os.environ.get("VRAM_PROGRAMS", REPO.parent / "shared" / "programs"))
#: real-GPU truth: programs, their recordings (one ``.tar.xz`` per run folder) and figures
GPU_TRUTH = Path(os.environ.get("VRAM_GPU_TRUTH", REPO.parent / "shared" / "gpu-truth"))
H200 = GPU_TRUTH / "h200-2026-11-27"


def truth_recording(name: str, dest: Path, folder: Path = H200) -> Path:
    """`NAME.pickle` from `folder`'s ``recordings.tar.xz``, extracted into `dest`."""
    import tarfile

    with tarfile.open(folder / "recordings.tar.xz", "r:xz") as tar:
        member = tar.getmember(f"{name}.pickle")
        out = dest / f"{name}.pickle"
        src = tar.extractfile(member)
        assert src is not None
        out.write_bytes(src.read())
    return out


def truth_figures(name: str, folder: Path = H200) -> dict:
    """The figures `record.py` measured for the run `name` (``figures.jsonl``)."""
    import json

    for line in (folder / "figures.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["name"] == name:
            return row
    raise KeyError(name)
