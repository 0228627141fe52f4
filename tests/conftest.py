"""Session set-up shared by every test module, and the opt-in ``slow`` tests.

The suite runs in parallel (``-n auto --dist loadgroup`` in pyproject.toml's pytest options:
one worker per core; each worker is its own process, so environment variables, patches and
``torch``'s global state stay per worker, and every test writes under its own ``tmp_path``).
A module whose tests share an expensive module-scoped fixture (a build, a recorded run) puts
them in one ``xdist_group`` so the fixture is made once. Tests marked ``slow`` (minutes each: see
the README) run only with ``--runslow`` or ``VRAM_SLOW_TESTS=1``.
"""
from __future__ import annotations

import os

import pytest

try:  # PyPI's torchvision is built for CUDA torch: let it (and transformers, which imports it) load
    from vram.run.cuda.compat import define_torchvision_ops
except ImportError:  # no torch: the tests that need it skip
    pass
else:
    define_torchvision_ops()


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile the package once, before the workers start: where ``PYTHONDONTWRITEBYTECODE``
    is set (as on the CI machines), every worker and every ``vram`` process a test starts would
    otherwise compile its modules from source again (about 0.3-0.4 s of CPU each)."""
    if hasattr(config, "workerinput"):
        return
    import compileall
    from pathlib import Path

    package = Path(__file__).resolve().parent.parent / "src" / "vram"
    if package.is_dir():
        try:
            compileall.compile_dir(package, quiet=2)
        except OSError:  # a read-only checkout: import compiles in memory, as before
            pass


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (as VRAM_SLOW_TESTS=1 does)")


def run_slow(config: pytest.Config) -> bool:
    return bool(config.getoption("--runslow") or os.environ.get("VRAM_SLOW_TESTS", "") not in ("", "0"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if run_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or VRAM_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
