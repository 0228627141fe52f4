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
