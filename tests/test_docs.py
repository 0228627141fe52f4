"""Every code block of the README and docs/ pastes: a Python block runs as written, and every
``vram`` command of a shell block parses and names files that exist (in the repository, or made
by an earlier command of the same page). A block whose first line is ``# sketch`` (a comment a
reader sees) is exempt: it shows the shape of a call with names the reader supplies.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vram.cli.commands import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
#: flags whose value is a file the command writes, not one it reads
OUTPUTS = {"-o", "--output", "--snapshot", "--html", "--value-report"}
INPUT_SUFFIXES = (".py", ".pickle", ".csv", ".json")


def _blocks(lang: str) -> list[tuple[Path, int, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m.group(1) == lang:
                out.append((page, text[:m.start()].count("\n") + 1, m.group(2)))
    return out


def _sketch(body: str) -> bool:
    return body.lstrip().startswith("# sketch")


def _id(block: tuple[Path, int, str]) -> str:
    return f"{block[0].relative_to(ROOT)}:{block[1]}"


PYTHON = [b for b in _blocks("python") if not _sketch(b[2])]


@pytest.mark.parametrize("block", PYTHON, ids=[_id(b) for b in PYTHON])
def test_python_block_runs(block: tuple[Path, int, str]) -> None:
    _, _, body = block
    if re.search(r"^\s*(import torch|from vram\.run)", body, re.M):
        pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", body], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


def _commands(body: str) -> list[tuple[str, list[str]]]:
    """(working directory relative to the root, argv) of each ``vram`` line, following ``cd``."""
    cwd, out = ".", []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value vram ...
            words = words[1:]
        if not words:
            continue
        if words[0] == "cd":
            cwd = os.path.normpath(os.path.join(cwd, words[1]))
        elif words[0] == "vram":
            out.append((cwd, words[1:]))
    return out


def _check(cwd: Path, argv: list[str], made: set[Path]) -> None:
    script: list[str] = []
    if argv[:1] == ["tune"] and "--" in argv:
        k = argv.index("--")
        argv, script = argv[:k], argv[k + 1:]
    args = build_parser().parse_args(argv)   # SystemExit (a bad flag) fails the test
    for flag, value in zip(argv, argv[1:]):
        if flag in OUTPUTS:
            made.add((cwd / value).resolve())
    reads = [a for a, before in zip(argv, ["", *argv]) if before not in OUTPUTS and a.endswith(INPUT_SUFFIXES)]
    if getattr(args, "module", False) is False and getattr(args, "script", None) and isinstance(args.script, str):
        reads.append(args.script)
    reads += script[:1]
    if args.command == "estimate":
        reads.append(args.model.split(":")[0] + ".py")
    for name in reads:
        path = (cwd / name).resolve()
        assert path.exists() or path in made, f"{name} (from {cwd}) does not exist"


SHELL = [b for b in _blocks("bash") if not _sketch(b[2]) and "vram " in b[2]]


@pytest.mark.parametrize("block", SHELL, ids=[_id(b) for b in SHELL])
def test_shell_block_commands_parse_and_name_existing_files(block: tuple[Path, int, str]) -> None:
    made: set[Path] = set()
    for page_block in _blocks("bash"):   # files an earlier block of the page made
        if page_block[0] == block[0] and page_block[1] < block[1]:
            for cwd, argv in _commands(page_block[2]):
                made |= {(ROOT / cwd / v).resolve() for f, v in zip(argv, argv[1:]) if f in OUTPUTS}
    for cwd, argv in _commands(block[2]):
        _check(ROOT / cwd, argv, made)


def test_the_checks_can_fail() -> None:
    made: set[Path] = set()
    with pytest.raises(AssertionError, match="does not exist"):
        _check(ROOT, ["replay", "no-such-recording.pickle"], made)
    with pytest.raises(SystemExit):
        _check(ROOT, ["replay", "recordings/cs336-s-mem.pickle", "--no-such-flag"], made)
    _check(ROOT, ["run", "--snapshot", "x.pickle", "examples/train.py"], made)
    _check(ROOT, ["explain", "x.pickle"], made)   # made by the run before it
