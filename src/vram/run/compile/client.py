"""The ``vram run`` side of the compile process (`vram.run.compile.worker`): started at the first
graph, reused for the rest of the run, stopped at its end; and the compiled wrappers cached by
graph, in the run and on disk (``$VRAM_CACHE/compile/wrappers``, default ``~/.cache/vram``), keyed
by the graph's code and nodes (its subgraphs and the modules its nodes come from included), the
inputs' metadata, the autocast and grad mode, the card, the torch build and this package's
sources, so a later run of the same program does not compile again.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

from .worker import read_frame, write_frame

_PACKAGE = Path(__file__).parent


class CompileUnavailable(RuntimeError):
    """No compile process can run here (named reason: no triton, no g++, its setup failed)."""


def _cache_folder() -> Path:
    return Path(os.environ.get("VRAM_CACHE", Path.home() / ".cache" / "vram")) / "compile" / "wrappers"


def _source_key() -> str:
    """This package's sources, the card figures the compile reads (`vram.devices.clocks`) and the
    torch build: a change to any compiles again."""
    import torch

    from vram.devices import clocks

    digest = hashlib.sha256(torch.__version__.encode())
    for path in sorted(_PACKAGE.glob("*.py")) + sorted(_PACKAGE.glob("*.cpp")) + [Path(clocks.__file__)]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


class CompileClient:
    """One compile process for a run's card (`card`: `cuda_process.prepare`'s keyword arguments)."""

    def __init__(self, card: dict[str, Any]) -> None:
        self.card = card
        self.process: subprocess.Popen[bytes] | None = None
        self.memo: dict[str, dict[str, Any]] = {}
        self.source_key = ""

    def _start(self) -> subprocess.Popen[bytes]:
        from importlib.util import find_spec

        if find_spec("triton") is None:
            raise CompileUnavailable("triton is not installed (pip install 'vram[compile]')")
        src = str(_PACKAGE.parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])]))
        process = subprocess.Popen([sys.executable, "-m", "vram.run.compile.worker", json.dumps(self.card)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert process.stdout is not None
        try:
            first = read_frame(process.stdout)
        except EOFError:
            first = {"setup_error": f"the compile process exited ({process.wait()})"}
        if "setup_error" in first:
            process.wait()
            raise CompileUnavailable(first["setup_error"])
        return process

    def compile(self, request: dict[str, Any]) -> dict[str, Any]:
        """The worker's answer for `request` (`worker.compile_request`), from the caches if there."""
        if not self.source_key:
            self.source_key = _source_key()
        key = hashlib.sha256(pickle.dumps((self.source_key, self.card, request["code"], request["graph"],
                                           request["inputs"], request["autocast"], request["grad"],
                                           request.get("cudagraphs", False), request.get("static_inputs"),
                                           request.get("max_autotune", False), request.get("fp32_precision"),
                                           sorted(request.get("inductor_config", {}).items())))).hexdigest()
        if key in self.memo:
            return self.memo[key]
        path = _cache_folder() / f"{key}.json"
        if path.exists():
            answer: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        else:
            answer = self._ask(request)
            if "sources" in answer or "not_modelled" in answer:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(answer), encoding="utf-8")
                tmp.replace(path)
        self.memo[key] = answer
        return answer

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.process is None:
            self.process = self._start()
        assert self.process.stdin is not None and self.process.stdout is not None
        write_frame(self.process.stdin, {k: v for k, v in request.items() if k != "code"})
        try:
            answer: dict[str, Any] = read_frame(self.process.stdout)
        except EOFError:
            self.process = None
            raise CompileUnavailable("the compile process exited while compiling") from None
        return answer

    def close(self) -> None:
        """End the compile process (it exits when its stdin closes)."""
        if self.process is not None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            self.process.wait()
            self.process = None
