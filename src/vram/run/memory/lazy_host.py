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
tensor the script holds (later ops use the mirror, so they see writes through the array, as on
the CPU); ``torch.default_generator.get_state()`` called directly sees the stream before any
deferred draws.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map

from vram.run.values.placeholders import needs_data

from .host_rng import Draw, Ledger, word_count
from .op_args import factory_numel, with_generator, written_tensors

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

#: bytes of computed intermediate values kept for later reads (`LazyHost._keep`): a few
#: [50257, 768] float32 tensors (GPT-2's embedding, 154 MB), a small share of a host's memory
KEEP_LIMIT = 1 << 30

Geometry = tuple[tuple[int, ...], tuple[int, ...], int, torch.dtype]


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype


def _view(storage: torch.UntypedStorage, g: Geometry) -> torch.Tensor:
    return torch.empty(0, dtype=g[3]).set_(storage, g[2], g[0], g[1])


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _zeros(nbytes: int) -> torch.UntypedStorage:
    return torch.zeros(nbytes, dtype=torch.uint8).untyped_storage()


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
                 on_unknown: Callable[[str], None], keep_limit: int = KEEP_LIMIT) -> None:
        self.limit = value_limit
        self.live: dict[int, LazyStorage] = {}
        self.ledger = Ledger()
        self.known_value = known_value  # a simulated tensor's known values (CPU), or None
        self.on_unknown = on_unknown  # told when a recipe used zeros for a value it did not know
        #: bytes of computed versions, (storage, version) -> bytes, oldest first (`_keep`)
        self.kept: OrderedDict[tuple[LazyStorage, int], torch.UntypedStorage] = OrderedDict()
        self.kept_bytes, self.keep_limit = 0, keep_limit

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
        written = written_tensors(func, args, kwargs)
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
        written = written_tensors(func, args, kwargs)
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
        its recipe reads, dependencies first (iteratively: recipes can be deep), each from the
        latest version of it that `kept` holds."""
        order: list[tuple[LazyStorage, int, int]] = []
        uses: dict[tuple[int, int], int] = {}
        seen: set[tuple[int, int]] = set()
        stack: list[tuple[LazyStorage, int, int]] = [(target, version, -1)]
        while stack:
            ls, v, start = stack.pop()
            if start >= 0:
                order.append((ls, v, start))
                continue
            if (id(ls), v) in seen or seen.add((id(ls), v)):
                continue
            start = max((u for (k, u) in self.kept if k is ls and u <= v), default=0)
            stack.append((ls, v, start))
            for j in range(start, v):
                for r in ls.steps[j].refs():
                    if r.ls is ls and r.version == j:
                        continue  # the storage being built, as it is at this step
                    key = (id(r.ls), r.version)
                    uses[key] = uses.get(key, 0) + 1
                    stack.append((r.ls, r.version, -1))
        memo: dict[tuple[int, int], torch.UntypedStorage] = {}
        for ls, v, start in order:
            st = self.kept.get((ls, start)) if start else None
            if st is not None and (start < v and (id(ls), start) not in seen or start == v and ls is target):
                self._unkeep(ls, start)  # read by nothing else here: built on in place, or the mirror
            elif st is not None and start < v:
                st = _bytes(torch.UntypedStorage(ls.nbytes)).copy_(_bytes(st)).untyped_storage()
            for j in range(start, v):
                step = ls.steps[j]
                st = self._apply(step, st, ls, j, memo)
                for r in step.refs():
                    key = (id(r.ls), r.version)
                    if key in uses and not (r.ls is ls and r.version == j):
                        uses[key] -= 1
                        if not uses[key] and key != (id(target), version):
                            memo.pop(key, None)
            memo[(id(ls), v)] = st if st is not None else _zeros(ls.nbytes)
            if v > start and ls is not target and v == len(ls.steps) and ls.ref is not None and ls.ref():
                self._keep(ls, v, st)
        return memo[(id(target), version)]

    def _keep(self, ls: LazyStorage, version: int, st: torch.UntypedStorage) -> None:
        """Keep a live storage's current bytes, computed on the way to another's: a later read (the
        next round of ``trunc_normal_``'s redraws) starts there. The oldest go beyond `keep_limit`."""
        if ls.nbytes > self.keep_limit:
            return
        self.kept[(ls, version)] = st
        self.kept_bytes += ls.nbytes
        while self.kept_bytes > self.keep_limit:
            self._unkeep(*next(iter(self.kept)))

    def drop_kept(self) -> None:
        """Let the kept bytes go (the run ended: nothing will read them)."""
        self.kept.clear()
        self.kept_bytes = 0

    def _unkeep(self, ls: LazyStorage, version: int) -> torch.UntypedStorage:
        self.kept_bytes -= ls.nbytes  # out of `kept`: the oldest, or a storage's new mirror
        return self.kept.pop((ls, version))

    def _apply(self, step: Step, st: torch.UntypedStorage | None, ls: LazyStorage, j: int,
               memo: dict[tuple[int, int], torch.UntypedStorage]) -> torch.UntypedStorage:
        """Run step `j` of `ls`'s recipe on `st` (None before its first step); returns the storage
        (a creation step's own output storage when it is exactly the storage's layout)."""
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
            gen, ticket = torch.Generator(), step.rng if isinstance(step.rng, tuple) else None
            gen.set_state(ticket[0].state_before(ticket[1]) if ticket else step.rng)
            result = with_generator(step.func)(*args, **dict(kwargs, generator=gen))
            if ticket:  # the state after its draws: where the next deferred draw starts
                ticket[0].states.setdefault(ticket[1] + 1, gen.get_state())
        else:
            result = step.func(*args, **kwargs)
        if step.out is None:
            return st  # type: ignore[return-value]  # written in place
        r = [x for x in tree_leaves(result) if isinstance(x, torch.Tensor)][step.out]
        if st is None and _geometry(r) == step.geometry and r.untyped_storage().nbytes() == ls.nbytes:
            return r.untyped_storage()
        st = _zeros(ls.nbytes) if st is None else st
        _view(st, step.geometry).copy_(r)  # type: ignore[arg-type]
        return st


def _replay(func: Any, args: Any, kwargs: dict[str, Any]) -> Callable[[torch.Generator], Any]:
    """Draw what `func` draws, on scratch tensors of its inputs' geometry (values not read)."""
    geos = tree_map(lambda x: Scratch(_geometry(x)) if isinstance(x, torch.Tensor) else
                    (_CPU if isinstance(x, torch.device) and x.type == "meta" else x), (args, kwargs))

    def replay(gen: torch.Generator) -> None:
        a, k = tree_map(lambda x: x.make() if isinstance(x, Scratch) else x, geos)
        with_generator(func)(*a, **dict(k, generator=gen))
    return replay
