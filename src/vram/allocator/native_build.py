"""Building the optional compiled allocator (`vram.allocator.native`): ``python3 -m
vram.allocator.native_build [DIR]`` compiles `COMPILED` with mypyc (``pip install mypy`` and a C
compiler) into ``vram/allocator/_native/`` or DIR; ``... native_build status`` says whether the
default build can be used. ``VRAM_NATIVE=1`` (or ``=DIR``) then runs it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .native import COMPILED, DEFAULT_DIR, ENV, GROUP, HERE, MANIFEST, _sources, _tag, _unusable

_SETUP = """
from setuptools import setup
from mypyc.build import mypycify
setup(name="vram-native", script_args=["build_ext", "--inplace"],
      ext_modules=mypycify({files!r}, group_name={group!r}, opt_level="3"))
"""


def build(out: Path = DEFAULT_DIR, quiet: bool = True) -> Path:
    """Compile `COMPILED` with mypyc into `out` (replacing what is there); returns `out`.

    Works on a copy of the installed ``vram`` sources in a temporary folder, so a failed build
    leaves nothing behind. Raises RuntimeError with the compiler's last lines if it fails.
    """
    package = HERE.parent
    with tempfile.TemporaryDirectory(prefix="vram-native-") as tmp:
        root = Path(tmp)
        shutil.copytree(package, root / "vram", ignore=shutil.ignore_patterns("__pycache__", "_native", "*.so"))
        files = [f"vram/allocator/{name}.py" for name in COMPILED]
        (root / "setup.py").write_text(_SETUP.format(files=files, group=GROUP))
        proc = subprocess.run([sys.executable, "setup.py"], cwd=root, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise RuntimeError(f"mypyc build failed:\n{tail}")
        built = sorted((root / "vram" / "allocator").glob("*.so")) + sorted((root / "vram" / "allocator").glob("*.pyd"))
        if len(built) != len(COMPILED) + 1:
            raise RuntimeError(f"mypyc build produced {[p.name for p in built]}, expected {len(COMPILED) + 1} modules")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for lib in built:
            shutil.copy2(lib, out / lib.name)
        (out / MANIFEST).write_text(json.dumps({"tag": _tag(), "sources": _sources()}, indent=1) + "\n")
    if not quiet:
        print(f"built {len(built)} modules into {out}; use them with {ENV}=1"
              + ("" if out == DEFAULT_DIR else f" (here: {ENV}={out})"))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python3 -m vram.allocator.native_build [DIR]`` / ``status``."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["status"] and len(args) <= 1 and not any(a.startswith("-") for a in args):
        try:
            build(Path(args[0]).resolve() if args else DEFAULT_DIR, quiet=False)
        except (RuntimeError, OSError) as exc:
            print(f"vram: {exc}", file=sys.stderr)
            return 1
        return 0
    if args == ["status"]:
        why = _unusable(DEFAULT_DIR)
        print(f"compiled allocator: {'built, usable with ' + ENV + '=1' if why is None else why}")
        return 0
    print("usage: python3 -m vram.allocator.native_build [DIR | status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
