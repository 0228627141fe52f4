"""The bookkeeping behind `vram.estimate` (layer 4; needs torch): which block is what, and when.

`Tracker` wraps the simulated allocator's ``malloc``/``free`` (instance attributes shadowing the
methods) to log every block with the phase and the innermost module (global forward pre/post hooks)
that allocated it, keeps each phase's allocated/reserved peak and the event index where it was
reached, and classifies the blocks live at any event: parameters, buffers, gradients and optimizer
state by marks placed on their storages; activations while autograd keeps them (a saved-tensor pack
hook returns a detached alias and a weak reference to it tells when autograd lets go); cuBLAS
workspaces from `vram.run.runtime`'s record of them; temporaries, the rest.
"""
from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from vram.frontend import memory as _memory

#: breakdown keys, in report order; all but the last add up to allocated bytes
CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries",
              "cublas_workspaces", "cache_fragmentation")
#: the communication buffers a multi-GPU layout adds (`vram.estimate.layout`): FSDP2's all-gather
#: input/output and unsharded parameters, its reduce-scatter input/output (the output that becomes
#: a sharded gradient counts as gradients), DDP's gradient buckets
COMM_CATEGORIES = ("all_gather_buffers", "reduce_scatter_buffers", "ddp_buckets")
CATEGORIES_DISTRIBUTED = CATEGORIES[:-1] + COMM_CATEGORIES + CATEGORIES[-1:]
_PRIORITY = {"cublas_workspaces": 0, "parameters": 1, "buffers": 2, "gradients": 3,
             "optimizer_state": 4, "all_gather_buffers": 5, "reduce_scatter_buffers": 5, "ddp_buckets": 5}


class Phase:
    __slots__ = ("peak", "event", "reserved_at_peak", "peak_reserved")

    def __init__(self, allocated: int, event: int, reserved: int) -> None:
        self.peak, self.event, self.reserved_at_peak, self.peak_reserved = allocated, event, reserved, reserved


class Tracker:
    """Logs every block the simulated allocator hands out or takes back, with phase and module."""

    def __init__(self, sim: Any, device: int = 0, distributed: bool = False) -> None:
        self.sim = sim
        self.alloc = _memory.get_allocator(device)
        self.site: str | None = None   # the category of what is allocated now (see `allocating_as`)
        self.categories = CATEGORIES_DISTRIBUTED if distributed else CATEGORIES
        self.stat_a = self.alloc.stats.allocated_bytes[0]
        self.stat_r = self.alloc.stats.reserved_bytes[0]
        self.size: list[int] = []  # block bytes (what memory_allocated counts)
        self.requested: list[int] = []  # bytes asked for (the tensor's storage)
        self.born: list[int] = []
        self.died: list[int] = []
        self.module: list[int] = []
        self.recomputed: set[int] = set()
        self.marks: dict[int, str] = {}
        #: [seq, saved at, released at (-1: still saved; -2: at the end of this backward), ref]
        self.saved: list[list[Any]] = []
        self.open_until_backward: list[list[Any]] = []
        self.ptr2seq: dict[int, int] = {}
        self.n = 0
        self.names = ["(outside any module)"]
        self.mod_index: dict[int, int] = {}
        self.types: dict[str, str] = {}
        self.stack = [0]
        self.root: nn.Module | None = None
        self.root_call: nn.Module | None = None  # the compiled model (`compiled`)
        self.observing: list[Any] | None = None  # the compiled graphs' observers `compiled_saved` is in
        self.iteration = 0
        self.phase = "setup"
        self.records: dict[tuple[int, str], Phase] = {}
        self.rec = self._record()
        self.auto = False
        self.recomputing = 0
        self.forward_end: dict[int, int] = {}  # iteration -> event index when its last forward ended

    def attach(self, model: nn.Module) -> None:
        """The model whose modules name the allocations (``named_modules`` paths)."""
        self.root = model
        for name, m in model.named_modules():
            self.mod_index[id(m)] = len(self.names)
            self.names.append(name or "(model)")
            self.types[name or "(model)"] = type(m).__name__

    # allocator hooks
    def install(self, module_hooks: bool = True) -> Callable[[], None]:
        """Log the allocator's calls; with `module_hooks`, name each allocation by the module
        running (global forward hooks: off under ``torch.compile``, where Dynamo would break the
        graph at each, see `compiled`)."""
        alloc, malloc0, free0 = self.alloc, self.alloc.malloc, self.alloc.free
        active = alloc.active

        def malloc(size: int, stream: int = 0) -> int:
            if self.auto and self.phase == "forward" and torch._C._current_autograd_node() is not None:
                self.set_phase("backward")
            ptr = malloc0(size, stream)
            if ptr:
                seq = len(self.size)
                blk = active.get(ptr)
                self.size.append(blk.size if blk is not None else size)
                self.requested.append(size)
                self.born.append(self.n)
                self.died.append(-1)
                self.module.append(self.stack[-1])
                if self.site is not None:
                    self.marks[seq] = self.site
                if self.recomputing:
                    self.recomputed.add(seq)
                self.ptr2seq[ptr] = seq
                self.n += 1
                rec, cur, res = self.rec, self.stat_a.current, self.stat_r.current
                if cur > rec.peak:
                    rec.peak, rec.event, rec.reserved_at_peak = cur, self.n, res
                if res > rec.peak_reserved:
                    rec.peak_reserved = res
            return ptr

        def free(ptr: int) -> None:
            free0(ptr)
            seq = self.ptr2seq.pop(ptr, None)
            if seq is not None:
                self.died[seq] = self.n
                self.n += 1

        alloc.malloc, alloc.free = malloc, free  # instance attributes shadow the methods
        hooks = [nn.modules.module.register_module_forward_pre_hook(self._pre),
                 nn.modules.module.register_module_forward_hook(self._post)] if module_hooks else []

        def uninstall() -> None:
            for hook in hooks:
                hook.remove()
            del alloc.malloc, alloc.free
            if self.observing is not None:
                self.observing.remove(self.compiled_saved)
                self.observing = None

        return uninstall

    def compiled(self, model: nn.Module, mode: str) -> nn.Module:
        """``torch.compile(model, mode=)`` (None for "default") whose calls count as the model's
        (the forward phase starts there) under the name "(compiled model)": its forward hooks run
        outside the compiled code, the module's own hooks stay off (`install`). What the compiled
        graphs save for the backward is named by module where the graph says which made it
        (`compiled_saved`)."""
        from vram.run.compile.compiled_graph import saved_observers

        saved_observers.append(self.compiled_saved)
        self.observing = saved_observers
        compiled = torch.compile(model, mode=None if mode == "default" else mode)
        self.mod_index[id(compiled)] = len(self.names)
        self.names.append("(compiled model)")
        self.types["(compiled model)"] = type(model).__name__
        self.root_call = compiled
        compiled.register_forward_pre_hook(self._pre)
        compiled.register_forward_hook(self._post)
        return compiled

    def compiled_saved(self, t: torch.Tensor, module: tuple[str, str] | None) -> None:
        """A tensor a compiled forward saves for the backward, made by the graph node whose
        innermost module is `module` (Dynamo's source and the class's name): its block belongs
        to that module of the model when the source names one of its modules, of that class
        (`module_at_source`); else it stays the compiled model's."""
        seq = self.seq_of(t)
        found = module_at_source(self.root, *module) if module is not None and seq is not None else None
        if found is not None and id(found) in self.mod_index:
            self.module[seq] = self.mod_index[id(found)]  # type: ignore[index]

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.auto and module in (self.root, self.root_call) and torch._C._current_autograd_node() is None:
            self.set_phase("forward")
        i = self.mod_index.get(id(module))
        if i is None:
            i = self.mod_index[id(module)] = len(self.names)
            self.names.append(f"({type(module).__name__}, not in the model)")
        self.stack.append(i)

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if len(self.stack) > 1:
            self.stack.pop()

    # phases
    def _record(self) -> Phase:
        return Phase(self.stat_a.current, self.n, self.stat_r.current)

    def set_phase(self, name: str) -> None:
        if name != "forward" and self.phase == "forward" and self.iteration:
            self.forward_end[self.iteration] = self.n
        if name != "backward" and self.phase == "backward":
            for entry in self.open_until_backward:
                entry[2] = self.n
            self.open_until_backward.clear()
        self.phase = name
        key = (self.iteration, name)
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = self._record()
        self.rec = rec

    def start_iteration(self, i: int) -> None:
        self.iteration, self.stack[1:] = i, []
        self.phase = ""
        self.set_phase("forward")

    # categories
    @contextmanager
    def allocating_as(self, category: str) -> Iterator[None]:
        """Blocks allocated inside are `category` (unless marked with a stronger one later)."""
        outer, self.site = self.site, category
        try:
            yield
        finally:
            self.site = outer

    def mark(self, t: Any, category: str) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
        b = self.sim.block_of(t)
        if b is None or not b.ptr:
            return
        seq = self.ptr2seq.get(b.ptr)
        if seq is not None:
            old = self.marks.get(seq)
            if old is None or _PRIORITY[category] < _PRIORITY[old]:
                self.marks[seq] = category

    def mark_grads(self, model: nn.Module) -> None:
        for p in model.parameters():
            if p.grad is not None:
                self.mark(p.grad, "gradients")

    def mark_optimizer(self, optimizer: Any) -> None:
        for state in getattr(optimizer, "state", {}).values():
            for v in (state.values() if isinstance(state, Mapping) else ()):
                if isinstance(v, torch.Tensor):
                    self.mark(v, "optimizer_state")

    def seq_of(self, t: Any) -> int | None:
        b = self.sim.block_of(t)
        return None if b is None or not b.ptr else self.ptr2seq.get(b.ptr)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """The saved-tensor pack hook: an activation for as long as autograd keeps what we return."""
        d = t.detach()  # not `t`: a saved output would hold its own grad_fn (a reference cycle)
        seq = self.seq_of(t)
        if seq is not None:
            entry: list[Any] = [seq, self.n, -1, None]

            def released(ref: Any, entry: list[Any] = entry) -> None:
                entry[2] = self.n

            entry[3] = weakref.ref(d, released)
            self.saved.append(entry)
        return d

    def save_until_backward_ends(self, t: torch.Tensor) -> None:
        """An activation until the current backward pass ends (a checkpointed block's input)."""
        seq = self.seq_of(t)
        if seq is not None:
            entry = [seq, self.n, -2, None]
            self.saved.append(entry)
            self.open_until_backward.append(entry)

    def breakdown(self, event: int, reserved: int,
                  requested: dict[str, int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """Categories and activations by module of the blocks live after `event` events; `requested`,
        if given, gets each category's bytes as asked for (block bytes exceed them by the 512-byte
        rounding and by remainders the allocator did not split off: spec §4)."""
        for ptr in self.sim.workspaces.values():
            seq = self.ptr2seq.get(ptr)
            if seq is not None:
                self.marks[seq] = "cublas_workspaces"
        cats = dict.fromkeys(self.categories, 0)
        mods: dict[str, int] = {}
        marks, size, died, module = self.marks, self.size, self.died, self.module
        saved = {e[0] for e in self.saved if e[1] <= event and (e[2] < 0 or e[2] >= event)}
        saved |= self.recomputed
        for seq, born in enumerate(self.born):
            if born >= event:
                break
            d = died[seq]
            if 0 <= d < event:
                continue
            cat = marks.get(seq) or ("activations" if seq in saved else "temporaries")
            cats[cat] += size[seq]
            if requested is not None:
                requested[cat] = requested.get(cat, 0) + self.requested[seq]
            if cat == "activations":
                name = self.names[module[seq]]
                mods[name] = mods.get(name, 0) + size[seq]
        cats["cache_fragmentation"] = reserved - sum(cats.values())
        return cats, dict(sorted(mods.items(), key=lambda kv: (-kv[1], kv[0])))


#: one step of a Dynamo source: ``.name``, ``.0`` (a ModuleList's child), ``[0]``, ``['key']``
_SOURCE_STEP = re.compile(r"\.([A-Za-z_]\w*|\d+)|\[(\d+)\]|\['([^']*)'\]")


def module_at_source(root: nn.Module | None, source: str, class_name: str) -> nn.Module | None:
    """The module Dynamo's `source` names when the compiled frame's ``self`` is `root` (sources
    start ``L['self']``; a checkpointed block's modules are reached through estimate's
    ``functools.partial``: ``L['self'].blocks.0.forward.args[0].__self__.up``), if it is of the
    class named `class_name`: a frame of another module (after a graph break) names its modules
    from its own ``self``, so a source that leads elsewhere names nothing."""
    prefix = "L['self']"
    if root is None or not source.startswith(prefix):
        return None
    obj: Any = root
    pos = len(prefix)
    while pos < len(source):
        step = _SOURCE_STEP.match(source, pos)
        if step is None:
            return None
        name, index, key = step.groups()
        try:
            obj = getattr(obj, name) if name is not None else obj[int(index)] if index is not None else obj[key]
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
        pos = step.end()
    cls = type(obj)
    return obj if isinstance(obj, nn.Module) and f"{cls.__module__}.{cls.__qualname__}" == class_name else None


def checkpoint_targets(model: nn.Module, policy: Any, blocks: list[nn.Module] | None = None) -> list[nn.Module]:
    """The modules `checkpoint=` wraps: every instance of the policy's classes; else `blocks` when
    given (a pipeline stage's, whose ModuleList torch.export made an ``InterpreterModule``); else
    every element of the outermost ModuleLists, else each child."""
    if isinstance(policy, type) or (isinstance(policy, tuple) and all(isinstance(c, type) for c in policy)):
        if blocks is not None:
            raise ValueError("checkpoint by module class under --pp: a pipeline stage's modules are torch.export "
                             "InterpreterModules, of no class to match; use checkpoint=True (each block)")
        return [m for m in model.modules() if isinstance(m, policy) and m is not model]
    if blocks is not None:
        return blocks
    lists: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for c in m.children():
            if isinstance(c, nn.ModuleList):
                lists.extend(c)
            else:
                walk(c)

    walk(model)
    return lists or list(model.children())


def apply_checkpoint(model: nn.Module, policy: Any, tr: Tracker, blocks: list[nn.Module] | None = None,
                     compiled: bool = False) -> None:
    """Wrap each `checkpoint_targets` module's forward in non-reentrant ``torch.utils.checkpoint``.

    The recomputation runs inside the autograd engine, under the simulation's function mode (see
    `vram.run.cuda.patches.patch_torch_extras`), so it is cast and routed as the forward was.
    `compiled` (the model runs under ``torch.compile``): the forward becomes
    ``functools.partial(checkpoint, forward, use_reentrant=False)`` and nothing of estimate's:
    Dynamo inlines the partial and traces the block as a ``tag_activation_checkpoint`` region,
    as it traces ``checkpoint(block, x, use_reentrant=False)`` written in the user's forward
    (estimate's bookkeeping around it lives in this package, which Dynamo skips: each block would
    break the graph and run eagerly). The recomputation is then the compiled backward's own.
    """
    from torch.utils.checkpoint import checkpoint as ckpt

    for m in checkpoint_targets(model, policy, blocks):
        if compiled:
            m.forward = functools.partial(ckpt, m.forward, use_reentrant=False)
            continue

        def forward(*args: Any, _orig: Any = m.forward, _m: nn.Module = m, **kwargs: Any) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                recompute = torch._C._current_autograd_node() is not None
                tr.recomputing += recompute
                depth = len(tr.stack)
                tr.stack.append(tr.mod_index.get(id(_m), 0))
                try:
                    return _orig(*a, **k)
                finally:  # a recomputation stops early by raising: inner post hooks never ran
                    del tr.stack[depth:]
                    tr.recomputing -= recompute

            for a in list(args) + list(kwargs.values()):
                if isinstance(a, torch.Tensor):
                    tr.save_until_backward_ends(a)  # the checkpoint keeps its inputs
            return ckpt(run, *args, use_reentrant=False, **kwargs)

        m.forward = forward


def wrap_checkpointed(model: nn.Module, policy: Any) -> None:
    """Replace each `checkpoint_targets` module in its parent by ``checkpoint_wrapper(module)``
    (non-reentrant ``torch.utils.checkpoint``), as torchtitan's ``apply_ac`` does before
    ``fully_shard``: FSDP2's hooks then run around the wrapper, whose ``forward`` frame Dynamo
    compiles on its own (the hooks are ``_dynamo_disable``d, so the graph breaks at each block)
    and traces as a ``tag_activation_checkpoint`` region. A ``functools.partial(checkpoint,
    forward)`` there would be a frame of ``checkpoint`` itself, which is ``_disable_dynamo``d
    (torch/utils/checkpoint.py): the block would run eagerly."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    for m in {id(m): m for m in checkpoint_targets(model, policy)}.values():
        parent, name = parents[id(m)]
        setattr(parent, name, checkpoint_wrapper(m))


def unpack(t: torch.Tensor) -> torch.Tensor:
    return t
