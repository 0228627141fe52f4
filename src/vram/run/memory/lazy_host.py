"""Host tensors that cost nothing until something needs their bytes.

The usual script builds its model on the CPU and then moves it: ``model = Model(); model.to("cuda")``.
On a GPU run the CPU copy exists for a moment; under ``vram run`` it would cost the CPU work and
host memory of a real initialisation (a 7B model: tens of GB) only to be discarded by the move.
So a CPU factory (``torch.empty/zeros/ones/full/rand/randn/randint/arange...``) with more than
`VALUE_LIMIT` elements makes a *lazy* host tensor: a meta tensor that the script sees as a CPU
tensor (``device``, ``is_cpu``), with a *recipe* instead of bytes — the factory, then every op
that wrote it (``uniform_``, ``normal_``, ``fill_``, ``mul_``, ``copy_`` from another lazy
tensor...). Ops whose inputs are lazy (and small host tensors, captured by value) give lazy
outputs; moving a lazy tensor to the simulated GPU charges the allocator and needs no bytes.

When bytes are needed — a value read (``item``, ``tolist``, printing, ``numpy``), ``data_ptr``,
``torch.save``, an op with a large real host tensor, a data-dependent op — the storage is
*materialized*: its recipe is computed on the CPU, exactly (random steps draw from a generator
in the state the default generator had when they ran, `vram.run.memory.host_rng`), and from then on it
is mirrored by a real storage that ops update directly. The default generator's stream stays the
GPU run's: deferred draws are settled before anything observes it.

Limits: ``Tensor.numpy()`` of a lazy tensor shares memory with its mirror, not with the meta
tensor the script holds (writes through the array are seen by later ops, as on the CPU, since
ops then use the mirror); ``torch.default_generator.get_state()`` called directly (not through
``torch.get_rng_state``) sees the stream before any deferred draws.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from vram.run.values.placeholders import needs_data

from .host_rng import Draw, Ledger, word_count

_CPU = torch.device("cpu")
_META = torch.device("meta")
#: torch factories that become lazy on the host when large (``torch.utils._device``'s
#: constructors, less those that carry host data or build sparse/nested/quantized tensors)
LAZY_FACTORIES = frozenset({"empty", "empty_permuted", "empty_strided", "zeros", "ones", "full", "rand",
                            "randn", "randint", "randperm", "arange", "range", "eye", "linspace", "logspace"})
#: ops that read only their inputs' geometry, not their values
_NO_READ = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                      "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"})
#: random ops whose draws do not depend on input values: deferred, replayed on scratch tensors
_REPLAYABLE = frozenset({"uniform_", "normal_", "random_", "exponential_", "cauchy_", "log_normal_",
                         "geometric_", "rand_like", "randn_like", "randint_like", "rand", "randn", "randint",
                         "randperm", "normal"})
#: random factories whose CPU kernel is ``empty`` then this in-place kernel (its draws)
_FACTORY_KERNEL = {"randn": "normal_", "rand": "uniform_"}
#: ops that change a storage's size or identity: lazy storages take them materialized
_RESHAPE_STORAGE = frozenset({"resize_", "resize_as_", "set_", "_resize_output_"})

Geometry = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype


def _view(storage: torch.UntypedStorage, g: Geometry) -> torch.Tensor:
    return torch.empty(0, dtype=g[3]).set_(storage, g[2], g[0], g[1])


def seeded(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _default_generator(kwargs: dict[str, Any]) -> bool:
    g = kwargs.get("generator")
    return g is None or g is torch.default_generator


class Ref:
    """A lazy tensor as an op saw it: its storage after `version` steps, viewed by `geometry`."""

    __slots__ = ("ls", "version", "geometry")

    def __init__(self, ls: LazyStorage, version: int, geometry: Geometry) -> None:
        self.ls, self.version, self.geometry = ls, version, geometry


class Const:
    """A small host tensor an op read, captured by value."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class Scratch:
    """An input whose values are not read (``zeros_like``) or not known: zeros of its geometry."""

    __slots__ = ("geometry", "unknown")

    def __init__(self, geometry: Geometry, unknown: bool = False) -> None:
        self.geometry, self.unknown = geometry, unknown

    def make(self) -> torch.Tensor:
        size, stride, _, dtype = self.geometry
        return torch.empty_strided(size, stride, dtype=dtype).zero_()


class Step:
    """One op of a recipe. `out` None: it wrote this storage in place (its written argument is
    a `Ref` to the storage at this step); else the storage is output number `out` of the op,
    laid out as `geometry`. `rng`: where its random draws start (a ledger ticket, or a saved
    generator state), or None."""

    __slots__ = ("func", "args", "kwargs", "out", "geometry", "rng")

    def __init__(self, func: Any, args: Any, kwargs: dict[str, Any], out: int | None,
                 geometry: Geometry | None, rng: Any) -> None:
        self.func, self.args, self.kwargs, self.out, self.geometry, self.rng = func, args, kwargs, out, geometry, rng

    def refs(self) -> list[Ref]:
        return [r for r in tree_leaves((self.args, self.kwargs)) if isinstance(r, Ref)]


class LazyStorage:
    """A host storage known by its recipe; `mirror` holds its bytes once materialized."""

    __slots__ = ("nbytes", "steps", "mirror", "ref")

    def __init__(self, nbytes: int, steps: list[Step]) -> None:
        self.nbytes, self.steps = nbytes, steps
        self.mirror: torch.UntypedStorage | None = None
        self.ref: Any = None  # the weak reference to the meta storage that unregisters it


class LazyHost:
    """The lazy host storages of one simulated run, and the CPU generator's ledger."""

    def __init__(self, value_limit: int, known_value: Callable[[torch.Tensor], torch.Tensor | None],
                 on_unknown: Callable[[str], None]) -> None:
        self.limit = value_limit
        self.live: dict[int, LazyStorage] = {}
        self.ledger = Ledger()
        self.known_value = known_value  # a simulated tensor's known values (CPU), or None
        self.on_unknown = on_unknown  # told when a recipe used zeros for a value it did not know

    # -- identity ---------------------------------------------------------------------------
    def of(self, t: Any) -> LazyStorage | None:
        if not self.live or not isinstance(t, torch.Tensor):
            return None
        try:
            return self.live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError, AttributeError):
            return None

    def storage(self, storage: Any) -> LazyStorage | None:
        return self.live.get(storage._cdata) if self.live else None

    def _register(self, t: torch.Tensor, step: Step) -> None:
        st = t.untyped_storage()
        key = st._cdata
        ls = LazyStorage(st.nbytes(), [step])
        live = self.live

        def died(ref: Any, key: int = key) -> None:  # the PyObject dies with its StorageImpl
            if live.get(key) is ls:
                del live[key]
        ls.ref = weakref.ref(st, died)
        live[key] = ls

    # -- creation ---------------------------------------------------------------------------
    def factory(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A CPU factory the function mode sent to meta: lazy when large, else real. (A size
        read off the arguments, `factory_numel`, decides without running the op on meta first.)"""
        host_kwargs = dict(kwargs, device=_CPU)
        numel = factory_numel(func.overloadpacket.__name__, args, kwargs)
        out = func(*args, **kwargs) if numel is None or numel > self.limit else None
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if (numel if numel is not None else sum(t.numel() for t in outs)) <= self.limit:
            if seeded(func) and _default_generator(kwargs):
                self.ledger.settle()
            return func(*args, **host_kwargs)
        rng = self._rng(func, args, host_kwargs, outs[0]) if seeded(func) else None
        for i, t in enumerate(outs):
            self._register(t, Step(func, args, host_kwargs, i, _geometry(t), rng))
        return out

    def needs_real(self, func: Any, args: Any, kwargs: dict[str, Any], inputs: list[Any]) -> bool:
        """Must this op (with lazy inputs, headed for no GPU) run on real bytes? Yes when an
        input is materialized or a large real host tensor, when it reshapes a storage or writes
        more than one lazy storage, or when its draws depend on values."""
        for t in inputs:
            ls = self.of(t)
            if ls is not None:
                if ls.mirror is not None:
                    return True
            elif not t.is_meta and t.numel() > self.limit:
                return True
        name = func.overloadpacket.__name__
        if name in _RESHAPE_STORAGE or (seeded(func) and name not in _REPLAYABLE):
            return True
        written = _written(func, args, kwargs)
        if any(not t.is_meta for t in written):  # a real host tensor written from lazy ones
            return True
        return len({id(ls) for t in written if (ls := self.of(t)) is not None}) > 1

    def on_host(self, func: Any, args: Any, kwargs: dict[str, Any], inputs: list[Any], explicit_meta: bool) -> Any:
        """An op on lazy host tensors with no simulated GPU in it: played on meta and recorded
        (its outputs lazy too; a copy the script asked to have on meta stays plain meta), or run
        on real bytes when it must be (`needs_real`, or meta cannot run it: data-dependent)."""
        if self.needs_real(func, args, kwargs, inputs):
            return self.run_real(func, args, kwargs)
        try:
            out = func(*self.on_meta(args), **self.on_meta(kwargs))
        except (RuntimeError, NotImplementedError) as e:
            if needs_data(e):
                return self.run_real(func, args, kwargs)
            raise
        self.record(func, args, kwargs, out, new_outputs=not explicit_meta)
        return out

    @staticmethod
    def on_meta(tree: Any) -> Any:
        """The op's arguments for its meta run: real host tensors (small ones, captured by
        value in the recipe) become meta tensors of the same geometry."""
        def twin(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not x.is_meta:
                return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=_META)
            return x
        return tree_map(twin, tree)

    def record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, new_outputs: bool = True) -> None:
        """After an op ran on meta with lazy inputs: its new storages are lazy (unless
        `new_outputs` is false: they went to a GPU), with this op as their recipe's first step;
        the lazy storages it wrote gain it as a step."""
        name = func.overloadpacket.__name__
        written = _written(func, args, kwargs)
        rng = None
        if seeded(func):
            target = written[0] if written else next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            rng = self._rng(func, args, kwargs, target)
        rec_args, rec_kwargs = self._capture(args, kwargs, no_read=name in _NO_READ)
        rec_kwargs.pop("generator", None)
        inputs = {st._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                  for st in (t.untyped_storage(),)}
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for i, t in enumerate(outs if new_outputs else ()):
            if t.is_meta and t.untyped_storage()._cdata not in inputs and self.of(t) is None:
                self._register(t, Step(func, rec_args, rec_kwargs, i, _geometry(t), rng))
        for t in written:
            ls = self.of(t)
            if ls is not None:
                ls.steps.append(Step(func, rec_args, rec_kwargs, None, _geometry(t), rng))

    def _capture(self, args: Any, kwargs: dict[str, Any], no_read: bool) -> tuple[Any, dict[str, Any]]:
        def cap(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                ls = self.of(x)
                if ls is not None and not no_read:
                    return Ref(ls, len(ls.steps), _geometry(x))
                if ls is None:
                    value = x if x.device.type == "cpu" else self.known_value(x)
                    if value is not None:
                        return Const(value.detach().clone())
                return Scratch(_geometry(x), unknown=ls is None)
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return x
        return tree_map(cap, (args, kwargs))

    def _rng(self, func: Any, args: Any, kwargs: dict[str, Any], target: torch.Tensor) -> Any:
        """Where the op's draws start: a ticket in the default generator's ledger, or the state
        of the script's own generator (which is advanced now, as the op would)."""
        name = func.overloadpacket.__name__
        words = word_count(_FACTORY_KERNEL.get(name, name), target)
        draw = Draw(words, None if words is not None else _replay(func, args, kwargs))
        gen = kwargs.get("generator")
        if gen is None or gen is torch.default_generator:
            return self.ledger.ticket(draw)
        state = gen.get_state()
        draw.apply(gen)
        return state

    # -- bytes ------------------------------------------------------------------------------
    def materialize(self, ls: LazyStorage) -> torch.UntypedStorage:
        """The storage's bytes, computed once; from now on the mirror is its value."""
        if ls.mirror is None:
            with _disable_current_modes(), torch._C.DisableTorchFunction():
                ls.mirror = self._evaluate(ls, len(ls.steps))
        return ls.mirror

    def real(self, t: torch.Tensor) -> torch.Tensor:
        """A real host view of lazy tensor `t`'s bytes (materializing them)."""
        mirror = self.materialize(self.of(t))  # type: ignore[arg-type]
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return _view(mirror, _geometry(t))

    def run_real(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Run the op on real bytes: lazy inputs materialized (their mirrors are written in
        place), results real; in-place results are the script's own tensors."""
        originals: dict[int, Any] = {}

        def sub(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and self.of(x) is not None:
                r = self.real(x)
                originals[id(r)] = x
                return r
            if isinstance(x, torch.device) and x.type == "meta":
                return _CPU
            return x
        real_args, real_kwargs = tree_map(sub, (args, kwargs))
        if seeded(func) and _default_generator(kwargs):
            self.ledger.settle()
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            out = func(*real_args, **real_kwargs)
        return tree_map(lambda r: originals.get(id(r), r), out)

    def _evaluate(self, target: LazyStorage, version: int) -> torch.UntypedStorage:
        """Compute `target`'s bytes after `version` steps, and every version of every storage
        its recipe reads, dependencies first (iteratively: recipes can be deep)."""
        order: list[tuple[LazyStorage, int]] = []
        uses: dict[tuple[int, int], int] = {}
        seen: set[tuple[int, int]] = set()
        stack: list[tuple[LazyStorage, int, bool]] = [(target, version, False)]
        while stack:
            ls, v, done = stack.pop()
            if done:
                order.append((ls, v))
                continue
            if (id(ls), v) in seen:
                continue
            seen.add((id(ls), v))
            stack.append((ls, v, True))
            for j, step in enumerate(ls.steps[:v]):
                for r in step.refs():
                    if r.ls is ls and r.version == j:
                        continue  # the storage being built, as it is at this step
                    key = (id(r.ls), r.version)
                    uses[key] = uses.get(key, 0) + 1
                    stack.append((r.ls, r.version, False))
        memo: dict[tuple[int, int], torch.UntypedStorage] = {}
        for ls, v in order:
            st = torch.UntypedStorage(ls.nbytes)
            if ls.nbytes:
                torch.empty(0, dtype=torch.uint8).set_(st, 0, (ls.nbytes,), (1,)).zero_()
            for j, step in enumerate(ls.steps[:v]):
                self._apply(step, st, ls, j, memo)
                for r in step.refs():
                    if r.ls is ls and r.version == j:
                        continue
                    key = (id(r.ls), r.version)
                    if key in uses:
                        uses[key] -= 1
                        if not uses[key] and key != (id(target), version):
                            memo.pop(key, None)
            memo[(id(ls), v)] = st
        return memo[(id(target), version)]

    def _apply(self, step: Step, st: torch.UntypedStorage, ls: LazyStorage, j: int,
               memo: dict[tuple[int, int], torch.UntypedStorage]) -> None:
        def arg(x: Any) -> Any:
            if isinstance(x, Ref):
                src = st if (x.ls is ls and x.version == j) else memo[(id(x.ls), x.version)]
                return _view(src, x.geometry)
            if isinstance(x, Const):
                return x.value
            if isinstance(x, Scratch):
                if x.unknown:
                    self.on_unknown(f"zeros {list(x.geometry[0])}")
                return x.make()
            return x
        args, kwargs = tree_map(arg, (step.args, step.kwargs))
        if step.rng is not None:
            gen = torch.Generator()
            gen.set_state(step.rng[0].state_before(step.rng[1]) if isinstance(step.rng, tuple) else step.rng)
            result = with_generator(step.func)(*args, **dict(kwargs, generator=gen))
        else:
            result = step.func(*args, **kwargs)
        if step.out is not None:
            r = [x for x in tree_leaves(result) if isinstance(x, torch.Tensor)][step.out]
            _view(st, step.geometry).copy_(r)  # type: ignore[arg-type]


def _size_numel(size: Any) -> int | None:
    """Elements of a size list (``empty/zeros/ones/full/rand/randn(size, ...)``), else None."""
    if not isinstance(size, (list, tuple)) or not all(type(n) is int for n in size):
        return None
    numel = 1
    for n in size:
        numel *= n
    return numel


def factory_numel(name: str, args: Any, kwargs: dict[str, Any]) -> int | None:
    """The elements a CPU factory call makes, read off its arguments at the torch-function level
    (``torch.zeros(2, 3)``, ``torch.randint(0, 9, (4,))``, ``torch.arange(8)``) or the aten level
    (sizes as lists); None when not plain numbers. A hint: deciding "small, so real" early skips
    the lazy path, and a wrong answer only makes a tensor real or lazy, never a wrong value."""
    if name in ("arange", "range"):
        nums = args[:3]
        if not nums or len(args) > 3 or not all(type(x) in (int, float) for x in nums):
            return None
        start, end, step = (0, nums[0], 1) if len(nums) == 1 else (*nums[:2], nums[2] if len(nums) == 3 else 1)
        if step == 0:
            return None
        span = (end - start) / step
        return max(0, math.ceil(span) if name == "arange" else math.floor(span) + 1)
    if name == "randperm":
        return args[0] if args and type(args[0]) is int else None
    if name == "eye":
        dims = args[:2]
        return dims[0] * dims[-1] if dims and all(type(n) is int for n in dims) else None
    if name in ("linspace", "logspace"):
        steps = args[2] if len(args) > 2 else kwargs.get("steps")
        return steps if type(steps) is int else None
    if name == "randint":
        return _size_numel(kwargs["size"] if "size" in kwargs else args[-1] if args else None)
    if "size" in kwargs:
        return _size_numel(kwargs["size"])
    if args and all(type(n) is int for n in args) and name not in ("full", "empty_strided", "empty_permuted"):
        return _size_numel(args)  # varargs sizes: torch.zeros(2, 3)
    return _size_numel(args[0]) if args else None


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an aten op writes (its schema's mutable arguments)."""
    if not func._schema.is_mutable:
        return []
    found: list[torch.Tensor] = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        found.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return found


def with_generator(func: Any) -> Any:
    """The overload of `func` that takes a ``generator=`` (``rand.default`` → ``rand.generator``,
    ``randint.low`` → ``randint.low_generator``)."""
    if any(a.name == "generator" for a in func._schema.arguments):
        return func
    name = "generator" if func._overloadname == "default" else func._overloadname + "_generator"
    return getattr(func.overloadpacket, name)


def _replay(func: Any, args: Any, kwargs: dict[str, Any]) -> Callable[[torch.Generator], Any]:
    """Draw what `func` draws, on scratch tensors of its inputs' geometry (values not read)."""
    geos = tree_map(lambda x: Scratch(_geometry(x)) if isinstance(x, torch.Tensor) else
                    (_CPU if isinstance(x, torch.device) and x.type == "meta" else x), (args, kwargs))

    def replay(gen: torch.Generator) -> None:
        a, k = tree_map(lambda x: x.make() if isinstance(x, Scratch) else x, geos)
        with_generator(func)(*a, **dict(k, generator=gen))
    return replay
