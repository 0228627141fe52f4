"""The optional compiled allocator (`vram.allocator.native`) against the pure-Python one.

The compiled modules are built with mypyc into a temporary folder, then `native_workloads.py`
runs in two fresh processes, with ``VRAM_NATIVE`` pointing at the build and without it: random
workloads under every allocator path and every recording must give byte-identical outputs. A
build that cannot be used — missing, for another interpreter, older than the sources, or one that
does not load — must say why once and leave the pure-Python allocator running.

Skipped only where no build can exist: mypyc, a C compiler or Python's headers missing. A build that fails
otherwise (mypyc rejecting a change to the allocator) fails here.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import vram
from vram.allocator import native, native_build

pytestmark = pytest.mark.xdist_group("test_native")  # the compiled allocator, built once

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "native_workloads.py"
SRC = str(Path(vram.__file__).resolve().parents[1])
PROBE = ("import json, sys; sys.path.insert(0, sys.argv[1]); import native_workloads as w; "
         "from vram.allocator import native; "
         "print(json.dumps([native.ACTIVE, w.digest(w.random_workload('max_split_size_mb:64', None, 3, 400))]))")


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mypyc", reason="mypyc (pip install mypy) builds the compiled allocator")
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build the compiled allocator")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python headers (Python.h) to build the compiled allocator")
    return native_build.build(tmp_path_factory.mktemp("native") / "build")


def _run(args: list[str], setting: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    if setting is not None:
        env[native.ENV] = setting
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    return proc


def _probe(setting: str | None) -> tuple[bool, str, str]:
    proc = _run(["-c", PROBE, str(HERE)], setting)
    active, digest = json.loads(proc.stdout)
    return active, digest, proc.stderr


@pytest.mark.slow  # the mypyc build takes about 5 minutes of CPU
def test_compiled_allocator_matches_pure_python_byte_for_byte(build: Path) -> None:
    pure = _run([str(WORKLOADS)], None)
    compiled = _run([str(WORKLOADS)], str(build))
    assert pure.stdout.splitlines()[0] == "native active: False"
    assert compiled.stdout.splitlines()[0] == "native active: True"
    assert compiled.stderr == ""
    lines = pure.stdout.splitlines()[1:]
    assert len(lines) >= 21  # 7 configs x 3 seeds, then two replays of each recording
    assert compiled.stdout.splitlines()[1:] == lines


def _copy(build: Path, dest: Path) -> Path:
    shutil.copytree(build, dest)
    return dest


@pytest.mark.slow  # the mypyc build takes about 5 minutes of CPU
def test_not_asked_for_not_used(build: Path) -> None:
    active, _, err = _probe(None)
    assert not active and err == ""
    active, _, err = _probe("0")
    assert not active and err == ""


@pytest.mark.slow  # the mypyc build takes about 5 minutes of CPU
@pytest.mark.parametrize("damage, why", [
    ("missing", "no compiled build in"),
    ("sources", "the sources changed since the build in"),
    ("tag", "is for cpython-20-elsewhere, not"),
    ("library", "does not load"),
])
def test_unusable_build_falls_back_to_pure_python(build: Path, tmp_path: Path, damage: str, why: str) -> None:
    _, expected, _ = _probe(None)
    folder = tmp_path / "missing" if damage == "missing" else _copy(build, tmp_path / "build")
    if damage in ("sources", "tag"):
        manifest = json.loads((folder / native.MANIFEST).read_text())
        if damage == "sources":
            manifest["sources"]["caching"] = "0" * 64
        else:
            manifest["tag"] = "cpython-20-elsewhere"
        (folder / native.MANIFEST).write_text(json.dumps(manifest))
    elif damage == "library":
        (lib,) = folder.glob("caching.*")
        lib.write_bytes(b"not a shared library")
    active, digest, err = _probe(str(folder))
    assert not active
    assert digest == expected
    assert err.count("RuntimeWarning") == 1 and why in err, err
    assert f"{native.ENV}={folder}: running the pure-Python allocator" in err


def test_record_stream_names_a_bad_pointer() -> None:
    """Found by the bad-input workload above: a pointer that is not an int got Python's format
    error ("Unknown format code 'x' ..."); it gets free()'s message, state untouched."""
    from vram import CachingAllocator, SimulatedDevice

    a = CachingAllocator(SimulatedDevice("1GiB"), "")
    p = a.malloc(1 << 20)
    before = a.memory_stats()
    for bad in ("x", 1.5, None, True):
        with pytest.raises(TypeError, match=f"^pointer must be an int, got {type(bad).__name__}$"):
            a.record_stream(bad, 3)
    assert a.memory_stats() == before
    a.record_stream(p, 3)
    a.free(p)
    assert a.memory_stats()["active.all.current"] == 1  # waits for stream 3's event
