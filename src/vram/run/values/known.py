"""Values a simulated run knows exactly, so control flow takes the GPU's branch.

A simulated CUDA tensor is a meta tensor: it has no data. But many values a script reads do
not depend on the model's arithmetic: masks, position ids, token ids, step counters, anything
built by factories (``ones``, ``zeros``, ``full``, ``arange``, ``randint``…) or copied from the
host (``torch.tensor(list, device="cuda")``, ``x.to("cuda")``, ``from_numpy``), and whatever small
ops compute from such tensors alone (``mask.all()``, ``torch.isin(ids, eos)``, ``ids.ne(pad).sum()``).
For those, every storage whose contents are known keeps a CPU copy (`ChargedStorage.value`), and
each aten op whose tensor inputs are all known runs a second time, on the CPU copies, to know its
outputs (in-place ops update the copies they write). Reading such a tensor (``.item()``,
``bool()``, ``.tolist()``, ``.cpu()``, printing) gives the exact value, and data-dependent ops
(``nonzero``, boolean indexing) get their real output shape.

Limits: a new storage's values are kept only up to `VALUE_LIMIT` elements (larger outputs are
unknown: the CPU work would approach the model's own arithmetic), and up to `DERIVED_LIMIT` when a
deterministic op computes them from kept values alone (a window's envelope, rotary tables).
Uninitialized memory (``empty``) is unknown. Random ops draw from the CPU generator, whose state is
restored afterwards (the script's CPU random stream is untouched), so their values are plausible,
not the GPU's. An op that fails on the CPU (a CUDA-only kernel) makes its outputs unknown. Reading
an unknown value stops the run with `DataDependentError` when the run is strict about values;
otherwise it is answered with a `placeholder` (zeros) and recorded in the run's
`vram.run.values.placeholders.ValueReport`, and small unknown inputs of an op are replaced by
placeholders too, their results marked as assumed.

A storage grown by ``resize_`` keeps its known bytes (CUDA copies them) and its new bytes read
as zeros, what a real-values run takes uninitialized memory to hold. A known write into a piece of
an unknown storage is kept aside until such pieces cover it (`define`).

In a real-values run (``--values real``, `vram.run.values.real_values`) the keep limit is lifted
(`SimState.value_limit`), uninitialized memory holds zeros, and an op that fails on the CPU
records why its outputs are unknown (`why`), which the report gives when they are read. The ops
on CPU copies run on `SimState.value_threads` intra-op threads (one by default).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from . import real_values
from .flat import map_call, tensors_of
from .limits import DERIVED_LIMIT, VALUE_LIMIT, HostMemoryError, cannot_allocate

if TYPE_CHECKING:  # the run state is passed in; values sit below the storages that hold them
    from vram.run.memory.storages import ChargedStorage, SimState

_CPU = torch.device("cpu")
#: in-place ops whose result does not depend on the old contents of the tensor they write
_OVERWRITE = frozenset({"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "exponential_",
                        "geometric_", "log_normal_", "cauchy_", "bernoulli_"})
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                            "empty_permuted", "resize_", "set_"})
#: ops that leave the storage's bytes as they were: ``resize_`` (CUDA copies them into a grown
#: one), ``set_`` (the tensor now views a storage that holds what it holds)
_KEEPS = frozenset({"resize_", "set_"})


#: device types that stand for a simulated GPU (meta; `vram.run.engine` adds its own)
SIMULATED_DEVICE_TYPES = {"meta"}
#: the CUDA index that the PrivateUse1 engine's device 0 stands for (`engine_index`)
ENGINE_OWN = [0]


def engine_index(index: int) -> int:
    """The PrivateUse1 engine's device index for CUDA index `index`, and the CUDA index for an
    engine index (the same swap both ways): ``ENGINE_OWN[0]`` (a launched rank's own GPU,
    ``LOCAL_RANK``) and 0 trade places, every other index is itself. Only without the engine's
    C++ device guard (no compiler, `vram.run.engine.native`; tests/test_engine_native.py): the
    autograd engine then has ready queues for PrivateUse1 device 0 only (torch's Python device
    guard counts one device: torch/csrc/acc/Module.cpp ``PythonDeviceGuard::deviceCount``;
    engine.cpp ``start_device_threads``), so the GPU a rank runs backward on must be engine
    device 0. With the C++ guard ``ENGINE_OWN[0]`` stays 0 and this is the identity."""
    own = ENGINE_OWN[0]
    return own if index == 0 else 0 if index == own else index


class Unknown(Exception):
    """Internal: an input whose values are not known."""


def cpu_value(sim: SimState, t: Any) -> torch.Tensor | None:
    """`t`'s values as a CPU tensor sharing the kept copy (a host tensor is itself); None when
    unknown. Callers that hand the result to the script must copy it."""
    if not isinstance(t, torch.Tensor):
        return None
    b = sim.block_of(t)
    if b is None:
        if sim.host.of(t) is not None:  # a lazy host tensor: its bytes, computed (vram.run.memory.lazy_host)
            return sim.host.real(t)
        return t if t.device.type == "cpu" else None
    if b.value is None:
        return None
    with torch._C.DisableTorchFunction():
        return torch.empty(0, dtype=t.dtype).set_(b.value, t.storage_offset(), t.size(), t.stride())


def known(sim: SimState, t: torch.Tensor) -> bool:
    """Are `t`'s values known (a host tensor, or a simulated one with a kept copy)?"""
    b = sim.block_of(t)
    return (b.value is not None) if b is not None else (t.device.type == "cpu" or sim.host.of(t) is not None)


def to_cpu(sim: SimState, x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        v = cpu_value(sim, x)
        if v is None:
            raise Unknown
        return v
    if isinstance(x, torch.device) and x.type in SIMULATED_DEVICE_TYPES:
        return _CPU
    return x


def why(sim: SimState, t: Any) -> str:
    """Why a real-values run does not know `t`'s values ("" when it has no reason to give)."""
    b = sim.block_of(t)
    if b is not None:
        return b.why
    return "a tensor on the meta device has no values" if isinstance(t, torch.Tensor) and t.is_meta else ""


def reason(sim: SimState, t: Any) -> str:
    """`why` as a suffix for a report line: " (…)" or ""."""
    text = why(sim, t) if sim.real_values else ""
    return f" ({text})" if text else ""


def overwrites(func: Any) -> bool:
    """Does the aten op replace every element of its first argument, whatever it held?"""
    return func.overloadpacket.__name__ in _OVERWRITE


def assumed(sim: SimState, t: Any) -> bool:
    """Was `t`'s known value computed from placeholders?"""
    b = sim.block_of(t)
    return b is not None and b.value is not None and b.assumed


def placeholder(t: torch.Tensor) -> torch.Tensor:
    """The value assumed for an unknown tensor: zeros of its shape and dtype, on the CPU.

    Zeros keep the usual checks on the path a GPU run takes when nothing is wrong: no NaN or
    inf (``isfinite(loss).all()`` is True), no token equal to a typical EOS id, losses that
    compare as small."""
    with torch._C.DisableTorchFunction():
        return torch.zeros(t.size(), dtype=t.dtype)


def to_cpu_assuming(sim: SimState, x: Any, used: list[Any]) -> Any:
    """`to_cpu`, but an unknown simulated tensor of at most `VALUE_LIMIT` elements becomes its
    `placeholder` (noted in `used`), unless the run is strict about values (then it is `to_cpu`:
    a strict run has no assumed values)."""
    if isinstance(x, torch.Tensor):
        v = cpu_value(sim, x)
        if v is not None:
            if assumed(sim, x):
                used.append(True)
            return v
        if sim.strict_values or sim.block_of(x) is None or x.numel() > VALUE_LIMIT:
            raise Unknown
        used.append(why(sim, x) or True)  # a real-values run keeps why, for the report
        return placeholder(x)
    return to_cpu(sim, x)


def _out_arguments(func: Any, kwargs: Any) -> list[Any]:
    """The tensors an ``out=`` overload writes whole (their old contents do not matter)."""
    if not kwargs:  # the common case, on every op: no schema walk
        return []
    return [kwargs[a.name] for a in func._schema.arguments if a.is_out and a.name in kwargs]


def run_on_cpu(sim: SimState, func: Any, args: Any, kwargs: Any, used: list[Any], out: Any = None,
               limit: int | None = None) -> Any:
    """`func` on the CPU copies of its inputs (`to_cpu_assuming`: small unknown inputs become
    placeholders, noted in `used`, unless the run is strict; else `Unknown`). The tensor
    an overwriting in-place op (``fill_``, ``copy_``, ``normal_``…) writes needs no old values.
    An op with only a CUDA kernel runs its CPU implementation (`real_values.CUDA_ONLY`; `out`:
    its simulated outputs, when known). `limit`: the most elements of a written tensor kept
    (`_limit`; the run's `value_limit` by default)."""
    limit = sim.value_limit if limit is None else limit
    rest: Any = args
    first: list[Any] = []
    if overwrites(func) and args and isinstance(args[0], torch.Tensor) and not known(sim, args[0]):
        if sim.block_of(args[0]) is None or args[0].numel() > limit:
            raise Unknown
        first, rest = [placeholder(args[0])], args[1:]
    outs = {id(t) for t in tensors_of(_out_arguments(func, kwargs))}

    def value(x: Any) -> Any:
        if id(x) in outs and not known(sim, x):
            if sim.block_of(x) is None or x.numel() > limit:
                raise Unknown
            return placeholder(x)
        return to_cpu_assuming(sim, x, used)
    cpu_args, cpu_kwargs = map_call(value, rest, kwargs)
    cpu_args = (*first, *cpu_args)
    cuda_only = real_values.CUDA_ONLY.get(func)
    kernel = func if cuda_only is None else (lambda *a, **k: cuda_only(sim, func, args, kwargs, (a, k), out))
    call = kernel if sim.value_threads is None else _threads(kernel, sim.value_threads)
    with torch._C.DisableTorchFunction():
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            # A GPU draw, made on the CPU generator and the script's CPU stream then put back
            # (the generator's own methods: torch.get_rng_state would settle deferred draws).
            # The simulated GPUs' stream goes on from draw to draw, as CUDA's Philox offset does:
            # a rejection-sampling loop (nn.init.trunc_normal_) redraws other values, not the same.
            state = torch.default_generator.get_state()
            if sim.device_rng is not None:
                torch.default_generator.set_state(sim.device_rng)
            try:
                return call(*cpu_args, **cpu_kwargs)
            finally:
                sim.device_rng = torch.default_generator.get_state()
                torch.default_generator.set_state(state)
        return call(*cpu_args, **cpu_kwargs)


def _threads(kernel: Any, n: int) -> Any:
    """`kernel` run with `n` intra-op threads, then the script's setting back (what the script
    sees from ``torch.get_num_threads()`` does not change; a set costs about half a µs)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        mine = torch.get_num_threads()
        if mine == n:
            return kernel(*args, **kwargs)
        torch.set_num_threads(n)
        try:
            return kernel(*args, **kwargs)
        finally:
            torch.set_num_threads(mine)
    return call


def _first_unknown(sim: SimState, func: Any, args: Any, kwargs: Any, inputs: list[Any]) -> str | None:
    """`why` of the first input (other than what an overwriting op or ``out=`` writes) whose values
    are unknown and that cannot stand in as a placeholder (the run is strict, it is larger than
    `VALUE_LIMIT`, or it is not simulated); None when there is none. One `block_of` per input:
    `known`, `why` and the placeholder test all read the same block."""
    skip = {id(args[0])} if args and overwrites(func) else set()
    if kwargs:
        skip.update(id(t) for t in tensors_of(_out_arguments(func, kwargs)))
    strict = sim.strict_values
    for t in inputs:
        if skip and id(t) in skip:
            continue
        b = sim.block_of(t)
        if b is not None:
            if b.value is None and (strict or t.numel() > VALUE_LIMIT):
                return b.why
        elif not (t.device.type == "cpu" or sim.host.of(t) is not None):
            return "a tensor on the meta device has no values" if isinstance(t, torch.Tensor) and t.is_meta else ""
    return None


_MUTABLE: dict[Any, bool] = {}  # by op: its schema's ``is_mutable`` (``func._schema`` is built on each read)


def _written(sim: SimState, func: Any, inputs: list[Any]) -> list[ChargedStorage]:
    """The simulated storages a mutable op may write (conservatively: all its simulated inputs)."""
    mutable = _MUTABLE.get(func)
    if mutable is None:
        mutable = _MUTABLE[func] = func._schema.is_mutable
    if not mutable:
        return []
    return [b for b in sim.blocks_of(inputs) if b is not None]


def propagate(sim: SimState, func: Any, args: Any, kwargs: Any, out: Any, inputs: list[Any],
              computed: Any = None, computed_assumed: bool = False) -> None:
    """After an aten op ran on meta: know its outputs' values if all its inputs are known (or,
    unless strict, unknown but small: then the outputs are computed from placeholders).

    `computed` is the op's CPU result when the caller already has it (data-dependent ops)."""
    if computed is None:
        unknown = _first_unknown(sim, func, args, kwargs, inputs)
        if unknown is not None:  # the common case (a large activation is unknown): return at once
            # new outputs start unknown already; a real-values run passes on why
            news = [(o, b) for o in tree_leaves(out) if (b := sim.block_of(o)) is not None] \
                if sim.real_values else []
            _forget(news, _written(sim, func, inputs), unknown)
            return
    outs = tensors_of(out)
    targets = [(t, b) for t, b in zip(outs, sim.blocks_of(outs)) if b is not None]
    written = _written(sim, func, inputs)
    if not targets and not written:
        return
    name = func.overloadpacket.__name__
    limit = sim.value_limit
    big = any(t.numel() > limit for t, _ in targets)
    if big and computed is None:  # the derived limit is asked only of outputs over the plain one
        limit = _limit(sim, func, args, kwargs, inputs)
        big = any(t.numel() > limit for t, _ in targets)
    if computed is None and sim.real_values and name in _UNINITIALIZED:
        for _, b in targets:  # uninitialized memory: zeros; set_/resize_ keep what the storage holds
            if b.value is None:
                b.value, b.why = sim.zeros(b.nbytes), ""
        return
    if computed is None and name in _KEEPS:
        return   # the storage holds what it held (a grown one: its old bytes, `SimState.carry`)
    if computed is None and (name in _UNINITIALIZED or big):
        _forget(targets, written)
        return
    used: list[Any] = [True] if computed_assumed else []
    try:
        result = computed if computed is not None else run_on_cpu(sim, func, args, kwargs, used, out, limit)
    except Unknown:
        _forget(targets, written)
        return
    except HostMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - no CPU kernel, or a CPU-only failure: the values are unknown
        if sim.real_values and cannot_allocate(e):  # never unknown for want of host memory: refused
            raise HostMemoryError(sim.host_refusal(f"{func} on the CPU could not allocate host memory")) from e
        _forget(targets, written, f"{func} failed on the CPU: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
        return
    results = tensors_of(result)
    if len(results) != len(outs):
        _forget(targets, written, f"{func} on the CPU returned {len(results)} tensors, not {len(outs)}")
        return
    by_out = dict(zip((id(t) for t in outs), results))
    for t, b in targets:
        value = by_out[id(t)]
        if value.shape != t.shape:  # the CPU kernel's output differs (eval batch_norm's save_mean: [0])
            b.forget(f"{func}'s CPU kernel gives this output shape {list(value.shape)}, not {list(t.shape)}")
        elif not big:
            define(sim, t, value, bool(used) or (b.assumed and func._schema.is_mutable), limit)
            if sim.real_values and used:  # computed from a placeholder: the report says why
                b.why = next((u for u in used if isinstance(u, str)), b.why)


def _limit(sim: SimState, func: Any, args: Any, kwargs: Any, inputs: list[Any]) -> int:
    """How many elements of `func`'s outputs are kept: `DERIVED_LIMIT` for a deterministic op
    with at least one simulated input whose every tensor input it reads is kept (simulated, or
    a host tensor no larger than `VALUE_LIMIT`: never a lazy host tensor, which would be
    computed; the tensor an overwriting op or an ``out=`` argument writes is not read), else the
    run's `value_limit`."""
    if sim.value_limit >= DERIVED_LIMIT or torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        return sim.value_limit
    skip = {id(args[0])} if overwrites(func) and args else set()
    skip.update(id(t) for t in tensors_of(_out_arguments(func, kwargs)))
    simulated = False
    for t in inputs:
        if id(t) in skip:
            continue
        b = sim.block_of(t)
        if b is not None:
            if b.value is None or b.assumed:
                return sim.value_limit
            simulated = True
        elif not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and sim.host.of(t) is None
                  and t.numel() <= VALUE_LIMIT):
            return sim.value_limit
    return DERIVED_LIMIT if simulated else sim.value_limit


def define(sim: SimState, t: torch.Tensor, value: torch.Tensor, assumed: bool, limit: int | None = None) -> None:
    """`t` now holds `value` (a CPU tensor of its shape); `assumed` when that rests on guesses.
    A write into part of an unknown storage, or into one too large to keep (more than `limit`
    elements, the run's `value_limit` by default), leaves it unknown."""
    b = sim.block_of(t)
    if b is None:
        return
    if b.value is None:
        if b.nbytes > (sim.value_limit if limit is None else limit) * t.element_size():
            return
        if not _covers(t, b):
            _fill(sim, t, b, value, assumed)
            return
        sim.reserve(b.nbytes)
        b.value, b.why, b.filling = torch.UntypedStorage(b.nbytes), "", None
    b.assumed = assumed
    view = cpu_value(sim, t)
    if view is not None and view.data_ptr() != value.data_ptr():
        with torch._C.DisableTorchFunction():
            view.copy_(value)


def _fill(sim: SimState, t: torch.Tensor, b: ChargedStorage, value: torch.Tensor, assumed: bool) -> None:
    """A known write into a contiguous piece of an unknown storage: kept aside (``filling``: the
    bytes so far, the byte ranges written, whether any rests on guesses) until the pieces cover
    the storage, which is then known (an ``empty`` buffer filled slice by slice, as the all-gather
    of ``all_gather_object`` fills its output)."""
    with torch._C.DisableTorchFunction():
        if not t.is_contiguous():
            return
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        if b.filling is None:
            sim.reserve(b.nbytes)
            b.filling = (torch.UntypedStorage(b.nbytes), [], False)
        data, spans, guessed = b.filling
        torch.empty(0, dtype=t.dtype).set_(data, t.storage_offset(), t.size(), t.stride()).copy_(value)
    spans = sorted([*spans, (start, end)])
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    b.filling = (data, merged, guessed or assumed)
    if merged == [(0, b.nbytes)]:
        b.value, b.why, b.assumed, b.filling = data, "", guessed or assumed, None


def _covers(t: torch.Tensor, b: ChargedStorage) -> bool:
    """Does `t` span its whole storage (so writing it defines every byte)?"""
    with torch._C.DisableTorchFunction():
        if t.storage_offset() or t.numel() * t.element_size() != b.nbytes:
            return False
        expected = 1  # non-overlapping and dense: strides, sorted, are the running products of sizes
        for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.size()) if n != 1):
            if stride != expected:
                return False
            expected *= size
        return True


def _forget(targets: list[tuple[Any, ChargedStorage]], written: list[ChargedStorage], why: str = "") -> None:
    """The values of the op's outputs and of what it wrote are unknown now (`why`: the reason a
    real-values run gives when they are read)."""
    for _, b in targets:
        b.forget(why)
    for b in written:
        b.forget(why)


def forget(sim: SimState, t: torch.Tensor) -> None:
    """`t`'s storage holds values this run does not know (another rank's data, say)."""
    b = sim.block_of(t)
    if b is not None:
        b.forget()


def meta_outputs(result: Any) -> Any:
    """Meta tensors shaped like the CPU `result` of a data-dependent op (``nonzero``, masks)."""
    def meta(r: Any) -> Any:
        if isinstance(r, torch.Tensor):
            with torch._C.DisableTorchFunction():
                return torch.empty_strided(r.size(), r.stride(), dtype=r.dtype, device="meta")
        return r
    return tree_map(meta, result)
