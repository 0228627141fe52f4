"""A probe of backward formulas (run by ``test_subclass_formulas.py`` in a child process): tensors on a
Python PrivateUse1 backend (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``)
whose every op runs on meta, with storages made through DLPack (NumPy's exporter) so that each
storage's death is reported and no storage Python object exists. No dispatch mode, no meta key: autograd sees
plain tensors. Prints, per formula family, how many gradient-sized storages its backward made."""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

sys.path.insert(0, str(Path(__file__).parent))
from test_subclass_formulas import FAMILIES, FULL  # noqa: E402

# the engine's DLPack structures and dtype codes (importing them registers nothing)
from vram.run.engine.dlpack import CODES, DLDataType, DLDevice, DLTensor  # noqa: E402

_setup_privateuseone_for_python_backend("vramsim")
META, CPU = torch.device("meta"), torch._C.DispatchKey.CPU
AS_STRIDED = torch.ops.aten.as_strided.default
MADE: list[int] = []
FREED: list[int] = []
GET_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
GET_POINTER.restype, GET_POINTER.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]


class Counter:
    """Addresses from a counter; nothing is freed (the family probe only counts)."""

    def __init__(self) -> None:
        self.next = 1 << 40

    def alloc(self, nbytes: int) -> int:
        self.next += max(nbytes, 512)
        return self.next

    def free(self, address: int) -> None:
        pass

    def plan(self, op, args, outs):  # type: ignore[no-untyped-def]
        return [("out", i) for i in range(len(outs))]


MEMORY = Counter()


class _Block:
    """Lives exactly as long as one storage: NumPy's DLPack deleter (C, under the GIL) drops the
    array that holds it, and CPython runs this finaliser with any pending error set aside — a
    storage may die while C++ unwinds a Python exception (a failed ``set_data``, an OOM)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes

    def __del__(self) -> None:
        FREED.append(self.nbytes)
        MEMORY.free(self.address)


def _storage(m: torch.Tensor) -> torch.Tensor:
    """A new storage for the meta output `m`, viewed as `m`: a NumPy array over the simulated
    address (never read) exported through DLPack, its device rewritten to kDLExtDev (12,
    PrivateUse1) and its dtype to `m`'s."""
    import numpy as np

    nbytes = m.untyped_storage().nbytes()
    address = MEMORY.alloc(nbytes)
    words = max(nbytes // m.element_size(), 1)
    memory = (ctypes.c_uint8 * (words * m.element_size())).from_address(address or 1 << 40)
    memory.block = _Block(address, nbytes)  # type: ignore[attr-defined]
    capsule = np.frombuffer(memory, dtype=np.uint8).__dlpack__()
    dl = DLTensor.from_address(GET_POINTER(capsule, b"dltensor"))
    code, bits = CODES[m.dtype]
    dl.device, dl.dtype, dl.shape[0] = DLDevice(12, 0), DLDataType(code, bits, 1), words
    MADE.append(nbytes)
    base = torch.utils.dlpack.from_dlpack(capsule)
    return AS_STRIDED._op_dk(CPU, base, m.shape, m.stride(), m.storage_offset())


def _on_meta(t: object) -> object:
    if isinstance(t, torch.device) and t.type == "vramsim":
        return META
    if isinstance(t, torch.Tensor) and t.device.type == "vramsim":
        return torch.empty(0, dtype=t.dtype, device=META).as_strided(t.shape, t.stride(), t.storage_offset())
    return t


def fallback(op, *args, **kwargs):  # type: ignore[no-untyped-def]
    """Run `op` on meta; new outputs get new storages, aliases view their input's storage, in the
    order of ``MEMORY.plan`` (a CUDA kernel's: outputs, scratch, the cuBLAS call)."""
    if op is torch.ops.aten._copy_from.default:  # copy_ from another device: into dst, in place
        return args[1]
    margs, mkwargs = tree_map(_on_meta, args), tree_map(_on_meta, kwargs)
    out = op(*margs, **mkwargs)
    outs = out if isinstance(out, tuple) else (out,)
    values = list(args) + [kwargs.get(a.name) for a in op._schema.arguments[len(args):]]
    results: list[object] = list(outs)
    for ret, o, i in zip(op._schema.returns, outs, range(len(outs))):
        alias = ret.alias_info
        if isinstance(o, torch.Tensor) and alias is not None:
            src = next(v for a, v in zip(op._schema.arguments, values)
                       if a.alias_info is not None and set(a.alias_info.before_set) & set(alias.before_set))
            if not alias.is_write:
                results[i] = AS_STRIDED._op_dk(CPU, src, o.shape, o.stride(), o.storage_offset())
            else:
                results[i] = src
    scratch: list[int] = []
    for step, arg in MEMORY.plan(op, margs, list(outs)):
        if step == "out" and arg < len(outs) and isinstance(outs[arg], torch.Tensor):
            o, alias = outs[arg], op._schema.returns[arg].alias_info
            if alias is None:
                results[arg] = _storage(o)
            elif alias.is_write and (tuple(results[arg].shape), results[arg].stride()) != (tuple(o.shape), o.stride()):
                torch.ops.aten.set_.source_Tensor._op_dk(CPU, results[arg], _storage(o))
        elif step == "tmp":
            scratch.append(MEMORY.alloc(arg))
        elif step == "free":
            MEMORY.free(scratch[arg])
        elif step == "blas":
            MEMORY.blas(op, margs, outs)
    return tuple(results) if isinstance(out, tuple) else results[0]


LIB = torch.library.Library("_", "IMPL")
LIB.fallback(fallback, "PrivateUse1")



def _bench(steps: int = 50) -> None:
    """``--bench``: ms per step of an 8-layer 256x256 MLP (96 aten ops) on meta with no mode, meta
    under a bare dispatch mode, this backend, and today's `simulated_cuda`."""
    import contextlib
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    from vram.run.runtime import simulated_cuda

    class Bare(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    def run(dev: str, ctx) -> float:  # type: ignore[no-untyped-def]
        with ctx():
            ws = [torch.randn(256, 256, device=dev, requires_grad=True) for _ in range(8)]
            x = torch.randn(32, 256, device=dev)
            for i in range(steps + 1):
                if i == 1:
                    t0 = time.perf_counter()
                h = x
                for w in ws:
                    h = torch.relu(h @ w) + h
                h.sum().backward()
                for w in ws:
                    w.grad = None
        return 1e3 * (time.perf_counter() - t0) / steps

    print(f"meta {run('meta', contextlib.nullcontext):.1f}  meta+mode {run('meta', Bare):.1f}  "
          f"privateuse1 {run('vramsim', contextlib.nullcontext):.1f}  "
          f"simulated_cuda {run('cuda', simulated_cuda):.1f}  (ms/step)")


def _run(script: str, gpu: str) -> int:
    """``--run SCRIPT GPU``: the script under `vram.run.runtime.run_script` with this backend in
    place of its two modes: a function mode sends ``device="cuda"`` here, and the fallback charges
    the simulated allocator in each kernel's order (`vram.run.kernels.plan.op_plan`)."""
    import contextlib

    from torch.overrides import TorchFunctionMode

    from vram.frontend import memory as _memory
    from vram.run import runtime as _rt
    from vram.run.kernels import blas as _blas
    from vram.run.kernels import plan as _plan

    class Simulated:
        def __init__(self, sim) -> None:  # type: ignore[no-untyped-def]
            self.sim = sim

        def alloc(self, nbytes: int) -> int:
            return self.sim.malloc(0, nbytes) if nbytes else 0

        def free(self, address: int) -> None:
            if not address or not self.sim.active:
                return
            if self.sim.busy:
                self.sim.pending.append((0, address))
            else:
                _memory.get_allocator(0).free(address)

        def plan(self, op, args, outs):  # type: ignore[no-untyped-def]
            name, props = op.overloadpacket.__name__, self.sim.props[0]
            steps = _plan.op_plan(name, args, outs, props.multi_processor_count, props.max_threads_per_multi_processor)
            if name in _blas.CUBLAS_OPS and ("blas", None) not in steps:
                steps = steps + [("blas", None)]
            return steps

        def blas(self, op, args, outs) -> None:  # type: ignore[no-untyped-def]
            if not (outs[0].is_floating_point() or outs[0].is_complex()):
                return
            props = self.sim.props[0]
            thread = "autograd" if torch._C._current_autograd_node() is not None else "main"
            key = (0, _memory.current_stream(0).cuda_stream, thread, "cublas")
            self.sim.workspace(key, _blas.cublas_workspace_size(props.major, props.minor))

    class ToBackend(TorchFunctionMode):
        def __init__(self, sim) -> None:  # type: ignore[no-untyped-def]
            super().__init__()
            global MEMORY
            MEMORY = Simulated(sim)

        def backward_scope(self, roots):  # type: ignore[no-untyped-def]  # FunctionMode's: nothing to leave
            return contextlib.nullcontext()

        def device_for(self, index):  # type: ignore[no-untyped-def]  # FunctionMode's: where GPU `index` lives
            return torch.device("vramsim", 0)

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            d = kwargs.get("device")
            if d is not None and torch.device(d).type == "cuda":
                kwargs = dict(kwargs, device=torch.device("vramsim", 0))
            return func(*args, **kwargs)

    _rt.DispatchMode = lambda sim: contextlib.nullcontext()  # type: ignore[assignment,misc]
    _rt.FunctionMode = ToBackend  # type: ignore[assignment,misc]
    return _rt.run_script(script, [], gpu=gpu)


if sys.argv[1:2] == ["--run"]:
    sys.exit(_run(sys.argv[2], sys.argv[3]))
if sys.argv[1:] == ["--bench"]:
    _bench()
    sys.exit(0)
for family, (program, *_rest) in FAMILIES.items():
    loss = program("vramsim")
    assert not torch._C._dispatch_isTensorSubclassLike(loss)
    MADE.clear()
    loss.backward()
    print(family, sum(1 for n in MADE if n == FULL))
x = program("vramsim")
FREED.clear()
del x
assert FREED, "the DLPack deleter reports a storage's death"
FREED.clear()
try:  # a storage that dies while C++ unwinds a Python error: reported, and the error survives
    torch.randn(2).data = torch.empty(3, device="vramsim")
except RuntimeError as e:
    assert "set_data" in str(e) and FREED
else:
    raise AssertionError("set_data across tensor types should fail")
