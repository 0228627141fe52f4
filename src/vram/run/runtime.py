"""Layer 4: run an unmodified PyTorch script as if on a CUDA GPU (``vram run``). Needs torch.

How it works, inside `simulated_cuda`:

* **Where tensors live.** A ``TorchFunctionMode`` (`vram.run.engine.function_mode`) rewrites
  every CUDA device argument ("cuda", "cuda:1", ``torch.device("cuda")``, an int index; ``device=``
  of factories, ``Tensor.to``, ``Tensor.cuda``, and so ``Module.to/cuda``) to the engine's
  PrivateUse1 device ``vramsim:N`` (`vram.run.engine`). Every aten op on such a tensor reaches one
  boxed fallback that runs it on meta (shapes, dtypes and strides, no data), so forward, backward
  and optimizer steps run at the cost of shape inference. To the script, such a tensor *is* a CUDA
  tensor: ``.device`` is ``cuda:N``, ``.is_cuda`` is True, ``.data_ptr()`` is its simulated
  address — so optimizers take their CUDA code paths (foreach Adam, as on a GPU) and
  ``torch.zeros(n, device=x.device)`` works.
* **What is allocated, and when.** The fallback sees every aten op after autograd — forward,
  backward and optimizer — with its outputs. Every *new* output gets a storage at its simulated
  address, charged to the simulated caching allocator (on the current stream) when the op runs,
  in the order of the CUDA kernel's allocations (`vram.run.kernels.plan`: cuBLAS workspaces,
  flash-attention scratch…); the storage's deleter frees the block the moment PyTorch frees the
  storage (its last tensor, view, or autograd saved-tensor reference dies).
* **Backward.** No dispatch mode is active while the model trains, so autograd takes the formulas
  it takes on a GPU. The engine's C++ device guard (`vram.run.engine.native`) counts the
  simulation's GPUs: the autograd engine runs each GPU's part of a backward on that GPU's thread.
* **Moves keep Parameters.** ``model.to("cuda")`` / ``.cuda()`` / ``.to_empty`` and ``p.data =
  p.data.cuda()`` keep every Parameter object, as ``set_data`` does on a GPU: tied weights stay
  tied (stored once), optimizers built before the move see the moved parameters, attributes and
  hooks stay (`vram.run.engine.function_mode.FunctionMode._set_data`).
* **Values.** A simulated tensor has no data, but values that need no model arithmetic are known
  exactly (`vram.run.values.known`): factories, host data copied over, and small ops on those alone
  (masks, ids, counters), so ``.item()``, ``bool(t)``, ``.tolist()``, printing, ``.cpu()`` and
  data-dependent ops (``nonzero``, boolean masks) give what the GPU would. Reading any other
  value raises `DataDependentError` naming the script line: invented values would silently steer
  control flow.
* **OOM.** The allocator's out-of-memory error surfaces as ``torch.OutOfMemoryError`` (alias
  ``torch.cuda.OutOfMemoryError``) with PyTorch's message, raised from the op that allocated; the
  op's already-allocated outputs are freed first, as C++ unwinding would.
* **autocast.** ``torch.autocast("cuda", dtype)`` / ``torch.cuda.amp.autocast`` set the autocast
  state, but PyTorch has no autocast policy for PrivateUse1, so the function mode applies CUDA's
  cast policy to the ops listed in `vram.run.kernels.plan` (lower precision: matmul/linear/conv/bmm/addmm/baddbmm/SDPA…;
  float32: softmax/log_softmax/layer_norm/losses…), with autocast's weight-cast cache (leaf float32
  tensors that require grad keep their cast copy until the outermost autocast exits). Casts are
  done right to left, the evaluation order GCC gives the C++ wrapper's argument pack.

Also: the autograd engine runs under the function mode, so Python code it calls (custom
``Function.backward``, hooks, ``torch.utils.checkpoint``'s recomputation) sees the simulated GPU as
the forward did (see `vram.run.cuda.patches.patch_torch_extras`); ``torch.compile`` runs eagerly,
``GradScaler.step`` steps without reading ``found_inf``, ``UntypedStorage.resize_`` is followed
(see `vram.run.cuda.api`). Limits: ops inside Python-level
torch functions (``F.multi_head_attention_forward``, ``F.normalize``…) are seen at the aten level
only, so they get no autocast casting or SDPA routing — except ``F.multi_head_attention_forward``
(``nn.MultiheadAttention``) and ``F.normalize``, whose inner calls the mode sees
(`vram.run.kernels.functions.TRANSPARENT`); ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` in
inference take PyTorch's fused path as on a GPU (`vram.run.kernels.fastpath`). ``--backend meta``
(`vram.run.engine.meta`) is a debugging aid: meta tensors under a dispatch mode, whose backward
formulas are PyTorch's out-of-place subclass ones (docs/estimate-accuracy.md §4).
Storage-level moves, which no mode sees
(``torch.load(map_location="cuda")``, a checkpoint saved on a GPU, ``storage.cuda()``), are
charged by `vram.run.memory.storage_api.patch_storages`, which also makes a simulated storage's
``data_ptr()`` its simulated address.
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from vram.allocator import history as _history
from vram.devices.gpus import GpuPreset, resolve_gpu
from vram.frontend import memory as _memory

from .compile.backend import install as install_compile
from .cuda.api import DeviceProperties, patch_torch_cuda
from .cuda.compat import define_torchvision_ops, refuse_cuda_ipc
from .cuda.patches import patch_torch_extras
from .distributed import install as install_distributed
from .engine import every_thread
from .engine.dynamo_guard import defer_dynamo_in_meta_kernels
from .engine.function_mode import FunctionMode
from .engine.privateuse1 import EngineLimit
from .kernels.cudnn import uncharged_note
from .kernels.fastpath import patch_fast_paths
from .memory.host_rng import patch_rng
from .memory.storage_api import patch_storages
from .memory.storages import SimState
from .values import host_heap, known
from .values.limits import HostMemoryError
from .values.placeholders import DataDependentError, ValueReport
from .values.rerun import ValuesNeeded

__all__ = ["BACKENDS", "VALUES", "DataDependentError", "HostMemoryError", "default_backend", "simulated_cuda",
           "run_script", "active_sim"]
#: the engines of a simulated run: the PrivateUse1 backend (`vram.run.engine`: every mode of
#: ``vram run`` and `vram.estimate`), or, as a debugging aid chosen by name, meta tensors under
#: a dispatch mode (`vram.run.engine.meta`), whose backward takes PyTorch's subclass formulas
BACKENDS = ("privateuse1", "meta")
#: what a simulated run knows of tensor values: "known" (what needs no model arithmetic,
#: `vram.run.values.known`; placeholders for the rest) or "real" (everything, `vram.run.values.real_values`)
VALUES = ("known", "real")
if os.environ.get("VRAM_RUN_BACKEND") != "meta":
    # before the process's first backward: the autograd engine sizes its per-device queues once
    # (engine.cpp ``device_ready_queues_``), so a device type registered later cannot backward
    from . import engine as _early_engine

    _early_engine.register()


def default_backend(device_count: int = 1) -> str:
    """``$VRAM_RUN_BACKEND``, else "privateuse1": every run, one GPU or several, one process or a
    torch.distributed rank, is on the PrivateUse1 engine (`vram.run.engine`). "meta" is a
    debugging aid, chosen by name only (``--backend meta``)."""
    return os.environ.get("VRAM_RUN_BACKEND") or "privateuse1"


def own_gpu(device_count: int) -> int:
    """The GPU this process runs its autograd on where the engine has one autograd device (its
    Python device guard, `vram.run.engine.native`): a torch.distributed rank's ``LOCAL_RANK`` (as
    torchrun sets it) when it names one of the process's GPUs, else 0."""
    local = os.environ.get("LOCAL_RANK", "0") if "WORLD_SIZE" in os.environ else "0"
    own = int(local) if local.isdigit() else 0
    return own if own < device_count else 0

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_VRAM_DIR = _history.PACKAGE_DIR
_MODE_FRAMES = tuple(os.path.join(_TORCH_DIR, p) for p in (  # frames only the modes add
    "_compile.py", os.path.join("_dynamo", "eval_frame.py"), os.path.join("utils", "_python_dispatch.py"),
    os.path.join("utils", "_device.py"), "overrides.py"))
_SIMULATION_FRAMES = (_VRAM_DIR, *_MODE_FRAMES)  # frames a simulated run adds to the script's
_ACTIVE: list[SimState] = []  # the running `simulated_cuda` blocks' state, innermost last


def _script_frame(frame: Any) -> Any:
    """Where a warning attributed to the simulation's own frame belongs: the frame that made the
    call the modes intercepted. A torch function written in Python reached the mode through
    ``handle_torch_function`` (torch/overrides.py), and its own frame is skipped too: on a GPU its
    ``stacklevel=2`` names that function's caller. A C++ method (``TORCH_WARN``) reached it
    directly: the caller is the frame outside the simulation."""
    while frame is not None and frame.f_code.co_filename.startswith(_SIMULATION_FRAMES):
        dispatched = frame.f_code.co_filename.endswith("overrides.py")
        frame = frame.f_back
        if dispatched and frame is not None:
            frame = frame.f_back  # the Python torch function that dispatched to the mode
    return frame


def _attributing_warnings() -> Callable[[], None]:
    """Warnings raised inside an intercepted torch call name the script's line, not the mode's
    (`_script_frame`); returns the restore."""
    original = warnings.showwarning

    def showwarning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                    line: Any = None) -> None:
        if filename.startswith(_VRAM_DIR):
            frame = sys._getframe(1)  # up to the frame the warning names, then out of the simulation
            while frame is not None and (frame.f_code.co_filename, frame.f_lineno) != (filename, lineno):
                frame = frame.f_back
            frame = _script_frame(frame)
            if frame is not None:
                filename, lineno, line = frame.f_code.co_filename, frame.f_lineno, None
        original(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning

    def restore() -> None:
        warnings.showwarning = original
    return restore


def active_sim() -> SimState | None:
    """The state of the innermost running `simulated_cuda` block, or None.

    A hook for tools built on a simulated run (`vram.estimate`): ``active_sim().block_of(t)`` is
    the simulated block of a tensor's storage, ``.workspaces`` the cuBLAS workspaces by key.
    """
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def simulated_cuda(gpu: int | str | GpuPreset = "80GiB", context: int | str = 0, conf: str | None = None,
                   device_count: int = 1, *, arch: str | None = None, name: str | None = None,
                   major: int | None = None, minor: int | None = None,
                   multi_processor_count: int | None = None, strict_values: bool = False,
                   backend: str | None = None, values: str = "known",
                   **simulate_kwargs: Any) -> Iterator[list[Any]]:
    """Run PyTorch code inside as if on `device_count` CUDA GPUs of `gpu` bytes each.

    `gpu` is a size ("24GiB", bytes) or a card (``"A100-80GB"``: its name, CUDA's total memory,
    compute capability and SM count; see `vram.devices.gpus`). `context` is the CUDA context's share of
    the GPU (what nvidia-smi shows on top of PyTorch's reserved memory); `conf` is a
    ``PYTORCH_CUDA_ALLOC_CONF`` string (None: read the environment). A size is otherwise an H100
    (sm90, 132 SMs); `arch` ("8.0", "sm_86") or `major`/`minor` change the compute capability,
    which decides cuBLAS's workspace size, and `multi_processor_count` flash attention's split
    heuristic. A read of a value the simulation does not know gets a placeholder, recorded in
    ``active_sim().report`` (`vram.run.values.placeholders.ValueReport`); `strict_values` makes it raise
    `DataDependentError` instead. `values` = "real" computes every value on the CPU, so no
    placeholder is needed (`vram.run.values.real_values`: host memory for a copy of every simulated
    storage; the allocator sees the same as with "known"). `backend` is the engine:
    "privateuse1" (`vram.run.engine`) or "meta" (meta tensors under two modes); None: `default_backend`. Yields the
    `vram.SimulatedDevice` list; the simulator's state (``vram.memory_summary()`` etc.) remains
    readable after the block.
    """
    backend = backend or default_backend(device_count)
    if backend not in BACKENDS:
        raise ValueError(f"unknown vram run backend {backend!r} (one of {', '.join(BACKENDS)})")
    if values not in VALUES:
        raise ValueError(f"unknown vram run values {values!r} (one of {', '.join(VALUES)})")
    define_torchvision_ops()  # a CUDA build of torchvision next to a CPU torch: importable
    defer_dynamo_in_meta_kernels()  # meta kernels import torch._dynamo only once something compiles
    spec = resolve_gpu(gpu, arch)
    name = spec.name if name is None else name
    major = spec.major if major is None else major
    minor = spec.minor if minor is None else minor
    sms = spec.multi_processor_count if multi_processor_count is None else multi_processor_count
    total = spec.total_memory
    devices = _memory.simulate(total, context, device_count, conf, name=name, **simulate_kwargs)
    props = [DeviceProperties(name, total, major, minor, sms) for _ in range(device_count)]
    sim, dispatch, function = _engine_for(backend, props, device_count)
    sim.strict_values = strict_values
    if values == "real":
        sim.real_values, sim.value_limit = True, sys.maxsize
        host_heap.give_back_freed()  # freed copies and kernel temporaries go back to the system
    restores = _install_patches(sim, function)
    _ACTIVE.append(sim)
    try:
        with dispatch, function:
            yield devices
    finally:
        sim.host.ledger.settle()  # code after the block uses the CPU generator where a GPU run's would be
        sim.host.drop_kept()
        _ACTIVE.remove(sim)
        for restore in restores:
            restore()
        sim.autocast_cache.clear()
        sim.active = False  # storages that outlive the block no longer touch the allocator
        sim.live.clear()
        if backend == "privateuse1":
            from . import engine as _engine

            _engine.privateuse1.pop(sim)  # type: ignore[arg-type]
            known.ENGINE_OWN[0] = 0


def _engine_for(backend: str, props: list[DeviceProperties], device_count: int) -> tuple[SimState, Any, Any]:
    """The run's state, its dispatch mode (none on the PrivateUse1 engine) and function mode."""
    if backend == "privateuse1":
        from . import engine as _engine

        _engine.register(device_count)
        known.ENGINE_OWN[0] = 0 if _engine.native.loaded() else own_gpu(device_count)
        sim: SimState = _engine.BackendState(props)
        function = _engine.BackendFunctionMode(sim)
        _engine.privateuse1.push(sim)  # type: ignore[arg-type]
        return sim, nullcontext(), function
    from .engine.meta import DispatchMode

    sim = SimState(props)
    return sim, DispatchMode(sim), FunctionMode(sim)


def _install_patches(sim: SimState, function: Any) -> list[Callable[[], None]]:
    """Patch torch for the run (``torch.cuda``, storages, the host generator, distributed, the
    fast paths, CUDA IPC, warnings, snapshot stacks); the restore functions, in the order to call."""
    restore = patch_torch_cuda(sim.props)
    restore_extras = patch_torch_extras(sim.autocast_cache.clear, lambda t: sim.block_of(t) is not None,
                                        sim.resize_storage, function,
                                        lambda t: known.known(sim, t) and not known.assumed(sim, t))
    sim.host.known_value = lambda t: known.cpu_value(sim, t)
    restore_storages = patch_storages(sim.storage_address, sim.storage_to, sim.storage_location, sim.storage_new)
    restore_rng = patch_rng(sim.host.ledger)
    restore_distributed = install_distributed(sim, function.device_for)  # init_process_group("nccl") on simulated GPUs
    restore_fast = patch_fast_paths((FunctionMode,))  # nn.MultiheadAttention's inference path, as on a GPU
    restore_ipc = refuse_cuda_ipc(lambda t: sim.block_of(t) is not None,
                                  lambda t: sim.host.real(t) if sim.host.of(t) is not None else None)
    restore_warnings = _attributing_warnings()
    restore_threads = every_thread.install(function, lambda: sim.active)  # threads and finalizers
    restore_compile = install_compile(function, sim.props[0])  # torch.compile: Inductor's CUDA wrappers
    _history.SKIP_PREFIXES.extend(_MODE_FRAMES)  # snapshot stacks without the modes' own frames

    def restore_prefixes() -> None:
        for prefix in _MODE_FRAMES:
            _history.SKIP_PREFIXES.remove(prefix)

    return [restore_compile, restore_threads, restore_ipc, restore_warnings, restore_fast, restore_distributed,
            restore_prefixes, restore_rng, restore_storages, restore_extras, restore]


def _print_exception(e: BaseException, report: ValueReport) -> None:
    """Print a traceback as Python would, without the frames the simulation itself adds, then
    `report`'s note when a line of it read a placeholder (`vram.run.values.placeholders.ValueReport.blame`)."""
    te = traceback.TracebackException.from_exception(e)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not f.filename.startswith((*_SIMULATION_FRAMES, "<frozen runpy"))
         and not f.filename.endswith("runpy.py")])
    sys.stdout.flush()
    sys.stderr.write("".join(te.format()))
    note = report.blame([(f.filename, f.lineno or 0) for f in te.stack])
    sys.stderr.write(note + "\n" if note else "")
    sys.stderr.flush()


def _report_reads(value_report: str | None, notes: bool) -> None:
    """When the script has ended: no host draw follows; with `notes`, the placeholder report and
    the uncharged-scratch notes on stderr; the report's JSON to `value_report`."""
    _ACTIVE[-1].host.ledger.drop()  # the script is over: nothing will draw again
    report = _ACTIVE[-1].report
    lines = [n for n in (report.render(), uncharged_note(_ACTIVE[-1].uncharged)) if n]
    if lines and notes:
        sys.stdout.flush()
        print("\n".join(lines), file=sys.stderr, flush=True)
    if value_report is not None:
        with open(value_report, "w") as f:
            f.write(report.as_json() + "\n")


def run_script(path: str, argv: Sequence[str] = (), *, summary: bool = False,
               on_exit: Callable[[], None] | None = None, value_report: str | None = None,
               values_fallback: bool = False, on_start: Callable[[], None] | None = None,
               module: bool = False, **sim_kwargs: Any) -> int:
    """Run the script at `path` with `argv` under `simulated_cuda`; returns its exit status.

    As ``python path argv...`` would: ``sys.argv`` and ``sys.path[0]`` are the script's,
    ``__name__ == "__main__"``, an uncaught exception prints its traceback and gives status 1
    (a `DataDependentError` prints its one-line message), ``sys.exit(n)`` gives n. `summary`
    prints ``torch.cuda.memory_summary()`` when the script ends (while its globals still hold their
    tensors); `on_exit` is called at that moment too. Reads answered with placeholder values are
    listed on stderr at the end, and written as JSON to `value_report` when given. `sim_kwargs`
    go to `simulated_cuda` (``strict_values=True``: stop at the first such read instead). What the
    engine cannot run (`vram.run.engine.EngineLimit`) is one line on stderr; a `DataDependentError`
    with `values_fallback` is raised from here, once the run is cleaned up, as
    `vram.run.values.rerun.ValuesNeeded`, for the caller to run the script again with real values.
    `on_start` is called once the simulated GPUs exist, before the script's first line (e.g. to
    start recording the allocation history). With `module`, `path` is a module name run as
    ``python -m path`` runs it (``sys.path[0]`` the current directory).
    """
    path = os.fspath(path)
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    sys.argv = [path, *argv]
    script_dir = os.getcwd() if module else os.path.dirname(os.path.abspath(path))
    if sys.path:
        sys.path[0] = script_dir
    else:
        sys.path.insert(0, script_dir)
    status = 0
    limit: ValuesNeeded | None = None
    try:
        with simulated_cuda(**sim_kwargs):
            result: Any = None
            if on_start is not None:
                on_start()
            try:
                result = (runpy.run_module(path, run_name="__main__", alter_sys=True) if module
                          else runpy.run_path(path, run_name="__main__"))
            except SystemExit as e:
                code = e.code
                status = code if isinstance(code, int) else (0 if code is None else 1)
                if code is not None and not isinstance(code, int):
                    print(code, file=sys.stderr)
            except DataDependentError as e:
                if values_fallback:
                    limit = ValuesNeeded(f"vram run: {e}")
                else:
                    sys.stdout.flush()
                    print(f"vram run: {e}", file=sys.stderr, flush=True)
                status = 1
            except HostMemoryError as e:
                sys.stdout.flush()
                print(f"vram run: {e}", file=sys.stderr, flush=True)
                status = 1
            except EngineLimit as e:
                sys.stdout.flush()
                print(e, file=sys.stderr, flush=True)
                status = 1
            except Exception as e:  # noqa: BLE001 - the script's own failure, reported as python would
                _print_exception(e, _ACTIVE[-1].report)
                status = 1
            finally:
                if summary:
                    print(_memory.memory_summary(), end="")
                if on_exit is not None:
                    on_exit()
                del result
                _report_reads(value_report, notes=limit is None)  # (a rerun gives its own)
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
    if limit is not None:
        raise limit
    return status
