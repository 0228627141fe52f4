"""The engine's PrivateUse1 device guard and hooks in C++ (``_device.cpp``), built on first use.

``torch._C._acc``'s Python device guard counts one device (torch/csrc/acc/Module.cpp
``PythonDeviceGuard::deviceCount``), so the autograd engine has a ready queue for PrivateUse1
device 0 only (engine.cpp ``start_device_threads``), and its Python hooks have no pinned-memory
allocator (DDP's used-parameter map, reducer.cpp ``all_reduce_local_used_map``). ``_device.cpp``
registers what a C++ backend would: a guard with as many devices as the simulation has and a
current device per thread, and hooks whose pinned memory is host memory. The operators stay
Python's (`vram.run.engine.privateuse1`). ``_fast.cpp``, a Python extension module built the
same way (`fast`), holds the compiled forms of parts of the engine's per-op path (new storages, a
tensor's block's place, the meta cache's key), each beside its Python reference, which is the
fallback.

It is compiled once per torch build and source into ``$VRAM_CACHE_DIR`` (default
``~/.cache/vram``) with the C++ compiler ``$CXX`` (default ``c++``) against the installed torch's
headers and libraries (about 5 s of CPU), under a file lock so that ranks started together build
it once; `load` must run before the Python guard is registered (PyTorch keeps the first). Where
it cannot be built (no compiler), the engine runs with the Python guard and refuses, in one line,
what needs several autograd devices or pinned memory (`why_not`).
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("_device.cpp")
FAST_SOURCE = Path(__file__).with_name("_fast.cpp")
#: the compiled module's name (``PyInit_vram_engine_fast`` in ``_fast.cpp``)
FAST_MODULE = "vram_engine_fast"
#: the device count registered at first: a node's GPUs, so that a later simulation with more
#: GPUs than the first finds autograd queues for them (the engine sizes them once per process)
FLOOR = 8
_LIB: list[ctypes.CDLL] = []
_WHY_NOT: list[str] = []
_FAST: list[Any] = []  # the compiled module, or None where it cannot be built or loaded


def _cache_dir() -> Path:
    chosen = os.environ.get("VRAM_CACHE_DIR")
    if chosen:
        return Path(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vram"


def _library_path(source: Path = SOURCE, stem: str = "engine-device") -> Path:
    """Where `source` built against this torch lives: the name carries a hash of both."""
    key = hashlib.sha256(source.read_bytes())
    key.update(f"{torch.__version__}|{torch.__file__}|{sys.version_info[:2]}".encode())
    return _cache_dir() / f"{stem}-{key.hexdigest()[:16]}.so"


def _build(target: Path, source: Path = SOURCE, python: bool = False) -> None:
    """Compile `source` into `target` (atomically: a temporary file, then renamed); `python`: a
    Python extension module, with Python's headers and ``libtorch_python``."""
    torch_dir = Path(torch.__file__).parent
    lib = torch_dir / "lib"
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    extra = [f"-I{sysconfig.get_paths()['include']}", "-ltorch_python"] if python else []
    cmd = [os.environ.get("CXX", "c++"), "-O1", "-shared", "-fPIC", "-std=c++20", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{torch_dir / 'include'}", str(source), "-o", tmp,
           f"-L{lib}", "-lc10", "-ltorch_cpu", *extra, f"-Wl,-rpath,{lib}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise OSError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "compiler failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _built(source: Path = SOURCE, stem: str = "engine-device", python: bool = False) -> Path:
    """The library of `source`, built under an exclusive lock if missing."""
    target = _library_path(source, stem)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _build(target, source, python)
    return target


def load(devices: int) -> bool:
    """Register the C++ guard and hooks for PrivateUse1 with at least `devices` devices; False
    (and `why_not` says why) when they cannot be built or another guard came first."""
    if _LIB:
        _LIB[0].vram_engine_devices(devices)
        return True
    if _WHY_NOT:
        return False
    try:
        lib = ctypes.CDLL(str(_built()))
    except (OSError, subprocess.SubprocessError) as e:
        _WHY_NOT.append(f"the engine's C++ device guard could not be built ({e})")
        return False
    if not lib.vram_engine_register(max(devices, FLOOR)):
        _WHY_NOT.append("another PrivateUse1 device guard was registered first")
        return False
    _LIB.append(lib)
    return True


def loaded() -> bool:
    """Is the C++ guard PrivateUse1's (several autograd devices, pinned memory)?"""
    return bool(_LIB)


def why_not() -> str:
    """Why the C++ guard is not PrivateUse1's ("" when it is)."""
    return _WHY_NOT[0] if _WHY_NOT else ""


def fast() -> Any:
    """The compiled module (``_fast.cpp``: ``new_storage``, ``place``, ``key``), built on first
    use; None where it cannot be built or loaded (the engine then keeps the Python references)."""
    if not _FAST:
        module = None
        try:
            path = _built(FAST_SOURCE, "engine-fast", python=True)
            loader = importlib.machinery.ExtensionFileLoader(FAST_MODULE, str(path))
            spec = importlib.util.spec_from_loader(FAST_MODULE, loader)
            if spec is not None:
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
        except (OSError, ImportError, subprocess.SubprocessError):
            module = None
        _FAST.append(module)
    return _FAST[0]
