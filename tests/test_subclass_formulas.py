"""Which backward formulas PyTorch picks, and why a simulated run picks others.

``at::isTensorSubclassLike`` (``aten/src/ATen/TensorSubclassLikeUtils.h``) is true for *every* tensor
while a ``TorchDispatchMode`` is active (``c10::impl::dispatch_mode_enabled()``) and, with no mode, for
any tensor whose key set has the Meta backend bit (``kTensorSubclassLike`` includes
``BackendComponent::MetaBit``). Backward formulas then take their out-of-place, subclass-safe paths:
gradient accumulation (``InputBuffer``'s ``can_accumulate_inplace``: add_ -> add),
``value_selecting_reduction_backward`` (scatter_ -> scatter), ``gather_backward`` (scatter_add_ ->
scatter_add), ``index_backward`` (``_index_put_impl_`` -> ``index_put``). And in torch 2.13 a
storage's Python object holds a reference to its ``StorageImpl`` (``c10/util/intrusive_ptr.h``, Note
[PyObject preservation for Tensor and Storages]), so ``storage().use_count() == 1`` in
``can_accumulate_inplace`` fails once anyone has called ``untyped_storage()`` on a gradient.

The PyTorch facts are asserted on CPU (plain tensors, no mode: the GPU's choices). A simulated
run's backward must allocate what the in-place formula does (from the source above, confirmed by
the CPU op lists): the PrivateUse1 engine (`vram.run.engine`) gives autograd plain tensors (no
dispatch mode, no Meta key, no storage object held), so it takes the GPU's formulas. The meta
engine (``--backend meta``, a debugging aid) cannot: its tensors are meta and its dispatch mode
is active.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from vram.run.runtime import simulated_cuda  # noqa: E402

N, M = 48, 40  # one N x M float32 gradient: 7,680 B, a size nothing else in these programs has
FULL = N * M * 4


def _accumulate(dev: str) -> torch.Tensor:
    x = torch.randn(N, M, device=dev, requires_grad=True)
    y = x.exp()
    return (y.sin() + y.cos()).sum()  # y's gradient buffer receives two dense gradients


def _max(dev: str) -> torch.Tensor:
    return torch.randn(N, M, device=dev, requires_grad=True).max(dim=1).values.sum()


def _gather(dev: str) -> torch.Tensor:
    x = torch.randn(N, M, device=dev, requires_grad=True)
    return x.gather(1, torch.zeros(N, 2, dtype=torch.long, device=dev)).sum()


def _index(dev: str) -> torch.Tensor:
    x = torch.randn(N, M, device=dev, requires_grad=True)
    return x[torch.zeros(2, dtype=torch.long, device=dev)].sum()


#: family: (program, the in-place op PyTorch runs on a GPU, its subclass-safe replacement,
#: N x M gradient-sized allocations of the backward with the in-place formula)
FAMILIES = {
    "accumulation": (_accumulate, "aten::add_", "aten::add", 6),  # cos, mul; sin, neg, mul; exp's mul
    "max": (_max, "aten::scatter_", "aten::scatter", 1),           # zeros
    "gather": (_gather, "aten::scatter_add_", "aten::scatter_add", 1),  # new_zeros
    "index": (_index, "aten::_index_put_impl_", "aten::index_put", 1),  # new_zeros
}


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _backward_ops(loss: torch.Tensor, mode: bool = False) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if mode:
            with _Mode():
                loss.backward()
        else:
            loss.backward()
    return [e.name for e in prof.events()]


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_tensors_take_the_in_place_formula(family: str) -> None:
    program, in_place, out_of_place, _ = FAMILIES[family]
    ops = _backward_ops(program("cpu"))
    assert in_place in ops and out_of_place not in ops


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_tensors_or_a_dispatch_mode_take_the_subclass_safe_formula(family: str) -> None:
    program, in_place, out_of_place, _ = FAMILIES[family]
    assert out_of_place in _backward_ops(program("meta"))
    assert out_of_place in _backward_ops(program("cpu"), mode=True)


def test_what_is_subclass_like() -> None:
    like = torch._C._dispatch_isTensorSubclassLike
    cpu, meta = torch.ones(2), torch.ones(2, device="meta")
    assert not like(cpu) and like(meta)
    with _Mode():
        assert like(cpu)
    with torch._C._EnablePythonDispatcher():  # the Python dispatcher alone is no mode ...
        assert not like(cpu) and like(meta)  # ... but cannot make a meta tensor plain


def test_a_gradients_storage_object_makes_accumulation_out_of_place() -> None:
    """Calling ``untyped_storage()`` on the first gradient into a buffer is enough (torch 2.13)."""
    def run(touch: bool) -> list[str]:
        x = torch.randn(N, M, requires_grad=True)
        y = x.exp()
        a, b = y.sin(), y.cos()
        loss = (a + b).sum()

        def post(grad_inputs, grad_outputs):  # type: ignore[no-untyped-def]
            for g in grad_inputs:
                if touch and g is not None:
                    g.untyped_storage()

        a.grad_fn.register_hook(post)
        b.grad_fn.register_hook(post)
        return [n for n in _backward_ops(loss) if n in ("aten::add", "aten::add_")]

    assert run(False) == ["aten::add_"]
    assert run(True) == ["aten::add"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_simulated_backward_allocates_what_the_in_place_formula_does(family: str) -> None:
    assert full_allocations_in_backward(family) == FAMILIES[family][3]


def full_allocations_in_backward(family: str, **sim_kwargs: Any) -> int:
    """How many `FULL`-sized blocks `family`'s backward allocates on a simulated GPU."""
    program = FAMILIES[family][0]
    with simulated_cuda(**sim_kwargs):
        loss = program("cuda")
        torch.cuda.memory._record_memory_history()
        loss.backward()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
    return sum(1 for e in trace if e["action"] == "alloc" and e["size"] == FULL)
