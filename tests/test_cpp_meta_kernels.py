"""The engine's meta runs on torch's C++ meta kernels (`vram.run.engine.cpp_meta`) give what torch's
Python meta kernels give, and a one-line script imports no sympy (a GPU run's C++ kernels do not).

Each check runs in a fresh process (the switch is once per process, and undone when
``torch.fx.experimental.symbolic_shapes`` is imported): this file run as a script with a mode.
``opinfo`` replays every aten call that OpInfo's samples (``torch.testing._internal``, which needs
expecttest) make on meta tensors — forward, backward, in place and ``out=`` — with torch's Python
kernels and with the C++ ones, and compares outputs (sizes, strides, dtype, storage offset and
size), inputs after the call, warnings and exception types; where they differ on a sample, the C++
kernel must give what the CPU kernel gives on CPU tensors of the same geometry (`_TENSOR_ITERATOR`).
``opinfo --list`` prints the ops that pass with all of them switched, for `OPS` after a torch upgrade.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k not in ("VRAM_RUN_BACKEND", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
ENV.update(PYTHONPATH=str(ROOT / "src"), PYTHONWARNINGS="ignore")


def _run(*args: str, timeout: int = 600) -> str:
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV, timeout=timeout,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_a_one_line_script_imports_no_sympy(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "one_line.py"
    script.write_text(textwrap.dedent("""\
        import sys
        import torch
        y = torch.ones(1024, device="cuda") * 2
        z = (y + 1).sum() / 3 - torch.ones(4, 4, device="cuda") @ torch.ones(4, 4, device="cuda")
        print([m for m in ("sympy", "torch.fx.experimental.symbolic_shapes") if m in sys.modules], tuple(z.shape))
    """))
    out = _run("-m", "vram", "run", "--gpu", "24GiB", str(script))
    assert out.split("\n")[0] == "[] (4, 4)"


def test_the_dispatcher_is_as_torch_left_it_once_symbolic_shapes_is_imported() -> None:
    pytest.importorskip("torch")
    assert _run(__file__, "restore").split() == ["cpp", "python", "same"]


def test_common_calls_give_the_python_kernels_outputs() -> None:
    pytest.importorskip("torch")
    assert _run(__file__, "common").split() == ["agree"]


@pytest.mark.slow
def test_every_op_switched_gives_the_python_kernels_outputs_on_opinfo_samples() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("expecttest")
    assert _run(__file__, "opinfo", timeout=3000).split()[-1] == "agree"


# ---- the checks, each in its own process ----

def _fresh(t: Any, device: str = "meta") -> Any:
    """A tensor of `t`'s geometry on `device`, over a storage as long as the view reaches (as the
    engine's meta copies are: `vram.run.engine.privateuse1._on_meta`)."""
    import torch

    if not (isinstance(t, torch.Tensor) and t.layout == torch.strided):
        return t
    shape, stride, offset = t.shape, t.stride(), t.storage_offset()
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if t.numel() else 0
    return torch.zeros(extent, dtype=t.dtype, device=device).as_strided(shape, stride, offset)


def _outcome(func: Any, args: Any, kwargs: Any, device: str = "meta") -> Any:
    """What a call gives: the geometry of its outputs and of its inputs after it, its warnings,
    or the type of what it raised."""
    import torch
    from torch.utils._pytree import tree_map

    args, kwargs = tree_map(lambda t: _fresh(t, device), (args, kwargs))

    def geometry(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            return (tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.layout, t.untyped_storage().nbytes())
        return t
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            got: Any = ("ok", tree_map(geometry, (func(*args, **kwargs), args, kwargs)))
        except Exception as e:  # noqa: BLE001 - the type is the outcome
            got = ("raised", type(e).__name__)
    return got, sorted(str(w.message) for w in seen)


def _compare(calls: list[tuple[str, Any, Any, Any]]) -> dict[str, list[str]]:
    """Each call's outcome with torch's Python meta kernels, then with `cpp_meta` activated; the
    ops whose outcomes differ where the CPU kernel's is not the C++ one's."""
    from vram.run.engine import cpp_meta

    python = [_outcome(f, a, k) for _, f, a, k in calls]
    assert cpp_meta.activate(symbolic=True)
    try:
        cpp = [_outcome(f, a, k) for _, f, a, k in calls]
    finally:
        cpp_meta.restore()
    differ: dict[str, list[str]] = {}
    for (name, f, a, k), p, c in zip(calls, python, cpp):
        if p == c:
            continue
        (cpu, _) = _outcome(f, a, k, "cpu")
        same = cpu == c[0] if cpu[0] == "raised" else cpu[0] == c[0][0] and cpu[1][0] == c[0][1][0]
        if name in _TENSOR_ITERATOR and same:
            continue  # the C++ kernel gives the CPU kernel's outputs (or its error)
        differ.setdefault(name, []).append(f"{p} / {c} / cpu {cpu}")
    return differ


#: ops whose C++ meta kernel differs from the Python one on some samples and gives the CPU kernel's
#: outputs or error: structured ``TensorIterator`` ops (native_functions.yaml ``structured_delegate``),
#: whose meta function CUDA's kernel runs too — the strides of an empty ``mul`` output, the broadcast
#: check of an in-place op whose ``self`` is smaller than the result (the Python kernels accept it)
_TENSOR_ITERATOR = frozenset(
    "atan2_ bitwise_and_.Tensor bitwise_left_shift_.Tensor bitwise_or_.Tensor bitwise_right_shift_.Tensor "
    "bitwise_xor_.Tensor clamp_max_.Tensor clamp_min_.Tensor copysign_.Tensor eq_.Tensor gcd_ ge_.Tensor "
    "gt_.Tensor heaviside_ hypot_ igamma_ igammac_ lcm_ le_.Tensor lt_.Tensor ne_.Tensor nextafter_ "
    "pow_.Tensor xlogy_.Tensor mul.Tensor".split())


def _common_calls() -> list[tuple[str, Any, Any, Any]]:
    import torch

    aten = torch.ops.aten
    m = torch.device("meta")
    a, b, t = torch.empty(4, 8, device=m), torch.empty(8, 3, device=m), torch.empty(8, 4, device=m).t()
    i = torch.empty(4, 8, dtype=torch.int64, device=m)
    empty = torch.empty(0, 5, 5, device=m).transpose(1, 2)
    return [(f._name[6:], f, args, kwargs) for f, args, kwargs in [
        (aten.mul.Tensor, (a, t), {}), (aten.mul.Scalar, (a, 2), {}), (aten.mul.Scalar, (i, 2.5), {}),
        (aten.mul.Tensor, (empty, torch.empty(0, 1, 5, device=m)), {}), (aten.add.Tensor, (i, a), {"alpha": 2}),
        (aten.div.Tensor_mode, (i, a), {"rounding_mode": "floor"}), (aten.sub.Scalar, (a, 1.5), {}),
        (aten.mul_.Tensor, (a, t), {}), (aten.add.out, (a, t), {"out": torch.empty(0, device=m)}),
        (aten.mm.default, (a, b), {}), (aten.addmm.default, (torch.empty(3, device=m), a, b), {}),
        (aten.sum.dim_IntList, (a, [1]), {}), (aten.mean.dim, (t, [0], True), {}),
        (aten._softmax.default, (a, 1, False), {}), (aten.gelu.default, (t,), {}),
        (aten.atan2_.default, (torch.empty(4, 1, device=m), a), {}), (aten.mm.default, (a, a), {}),
        (aten.mse_loss.default, (a, a), {}),
    ]]


def _opinfo_calls() -> list[tuple[str, Any, Any, Any]]:
    """Every call of an op in torch's meta library that OpInfo's samples make on meta tensors."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves, tree_map

    from vram.run.engine import cpp_meta

    ours = {key.split("/")[1] for key in cpp_meta._library()._op_impls}
    calls: list[tuple[str, Any, Any, Any]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func.namespace == "aten" and func._name[6:] in ours:
                calls.append((func._name[6:], func, *tree_map(_fresh, (args, kwargs))))
            return func(*args, **kwargs)

    warnings.filterwarnings("ignore")
    for info in op_db:
        for dtype in (torch.float32, torch.int64):
            if dtype not in info.supported_dtypes("cpu"):
                continue
            try:
                samples = list(info.sample_inputs("meta", dtype, requires_grad=dtype.is_floating_point
                                                  and info.supports_autograd))[:3]
            except Exception:  # noqa: BLE001,S112 - a sample generator that needs data
                continue
            for s in samples:
                _record_sample(info, s, Record, tree_leaves, tree_map)
    return calls


def _record_sample(info: Any, s: Any, record: Any, tree_leaves: Any, tree_map: Any) -> None:
    import torch

    try:
        with record():
            out = info.op(s.input, *s.args, **s.kwargs)
            outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            ins = [t for t in tree_leaves((s.input, s.args, s.kwargs))
                   if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs and ins:
                torch.autograd.grad([o.sum() for o in outs], ins, allow_unused=True)
    except Exception:  # noqa: BLE001,S110 - samples meta kernels refuse: nothing to compare
        pass
    with torch.no_grad():
        try:
            if info.inplace_variant is not None and isinstance(s.input, torch.Tensor):
                with record():
                    info.inplace_variant(_fresh(s.input.detach()), *s.args, **s.kwargs)
        except Exception:  # noqa: BLE001,S110
            pass
        try:
            if info.supports_out:
                out = tree_map(lambda t: torch.empty(0, dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor)
                               else t, info.op(s.input, *s.args, **s.kwargs))
                with record():
                    info.op(s.input, *s.args, **s.kwargs, out=out)
        except Exception:  # noqa: BLE001,S110
            pass


def _main(mode: str, *flags: str) -> None:
    import torch

    from vram.run.engine import cpp_meta

    if mode == "restore":
        lib = cpp_meta._library()
        names = sorted(key.split("/")[1] for key in lib._op_impls)
        before = [torch._C._dispatch_dump(f"aten::{n}") for n in names]
        assert "torch.fx.experimental.symbolic_shapes" not in sys.modules and cpp_meta.activate()
        meta_line = next(line for line in torch._C._dispatch_dump("aten::mul.Tensor").splitlines()
                         if line.startswith("Meta:"))
        print("cpp" if "RegisterMeta" in meta_line else meta_line)
        import torch.fx.experimental.symbolic_shapes  # noqa: F401
        print("python" if not cpp_meta.active() else "cpp")
        print("same" if before == [torch._C._dispatch_dump(f"aten::{n}") for n in names] else "changed")
        return
    calls = _common_calls() if mode == "common" else _opinfo_calls()
    if "--list" in flags:  # every op reached on its C++ kernel, less those that differ, until none does
        cpp_meta.OPS = frozenset(c[0] for c in calls)
        while differ := _compare(calls):
            cpp_meta.OPS -= set(differ)
        print(sorted(cpp_meta.OPS))
    elif mode == "opinfo":
        calls = [c for c in calls if c[0] in cpp_meta.OPS]
        unreached = cpp_meta.OPS - {c[0] for c in calls}
        assert not unreached, f"ops of OPS no sample reaches: {sorted(unreached)}"
    differ = _compare(calls)
    for name, why in sorted(differ.items()):
        print(name, len(why), why[0][:300])
    print("agree" if not differ else "differ")


if __name__ == "__main__":
    _main(*sys.argv[1:])
