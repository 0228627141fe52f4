"""CUDA graph trees (``mode="reduce-overhead"``) on the simulated GPU, as
torch/_inductor/cudagraph_trees.py runs a compiled graph's partitions on a GPU.

Inductor wraps each graph partition with ``cudagraphify`` (output_code.py
``cudagraph_partition_post_compile``; its static inputs: parameters and buffers, and in a backward
the saved tensors). Per device one ``CUDAGraphTreeManager`` (`TreeManager`), made at the first
call: a side stream, a pool (``graph_pool_handle``) and an empty graph captured into it (which
keeps the pool and makes the default generator's two 8-byte tensors, on the side stream). A call
of a function (`TreeManager.run`, ``_run``):

- a function's first call, and every call while the path is warming up, is a *warm-up*
  (``run_eager``, ``CUDAWarmupNode.run``): run eagerly with the calling thread's allocations routed
  to the pool on the side stream (``_use_cuda_memory_pool_manager``), the cuBLAS workspaces
  cleared before and after (``clear_cublas_manager``): whatever the run allocates (autotuning's
  flush buffers and clones, workspaces) is the pool's;
- else a recorded node of the tree that the inputs fit (``check_invariants``: the static inputs
  at the recorded addresses, graph-managed inputs the path's outputs) is *replayed*: nothing is
  allocated; its outputs are the pool's memory (`vram.run.memory.storages.UNCHARGED_BASE`);
- else the function is *recorded* (``CUDAGraphNode``): its non-static inputs copied into the
  pool (``_allocate_and_copy_recording_inputs``: ``static_input``, on the side stream), then run
  inside ``torch.cuda.graph(graph, pool=, stream=)`` (whose entry empties the cache), the cuBLAS
  workspaces cleared around it. Each graph keeps the pool.

A path ends (``try_end_curr_warmup`` / ``try_end_curr_recording`` / ``try_end_curr_execution``)
when a new ``torch.compile`` invocation starts a generation (Dynamo's ``GenerationTracker``, or
``torch.compiler.cudagraph_mark_step_begin``) with no forward waiting for its backward: then the
outputs of the path still alive are freed (``dealloc_current_path_weakrefs``), or when all its
outputs are dead. Not modelled (said once): recording or warming up while a replayed path's
outputs are alive (``apply_checkpoint_execution_state_in_allocator`` re-marks them in the pool),
the re-record limit and functions that mutate inputs outside the pool (run eagerly on a GPU).
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vram.frontend import memory as _memory
from vram.frontend.graphs import allocating_to_pool

FORWARD, BACKWARD, INFERENCE = "forward", "backward", "inference"
CHECKPOINT = ("CUDA graph trees: a recording or warm-up while a replayed path's outputs are alive "
              "(the pool's checkpointed state) is not modelled: the pool holds what its recordings left")


def _generation() -> int:
    """``CUDAGraphTreeManager.get_curr_generation``: the user's mark-step counter, else Dynamo's."""
    from torch._dynamo.mutation_guard import GenerationTracker
    from torch._inductor.cudagraph_trees import MarkStepBox

    return MarkStepBox.mark_step_counter if MarkStepBox.mark_step_counter != 0 else GenerationTracker.generation


class Function:
    """A ``WrappedFunction``: a partition, its static input indices and mode."""

    def __init__(self, fid: int, model: Callable[[list[Any]], Any], static: list[int], mode: str) -> None:
        self.id, self.model, self.static, self.mode = fid, model, frozenset(static), mode


class Node:
    """A ``CUDAWarmupNode`` (`recorded` False) or ``CUDAGraphNode`` of the tree: its outputs'
    blocks (`vram.run.memory.storages.ChargedStorage`; None where not the pool's), and for a
    recorded node what each input was when recorded."""

    def __init__(self, function: Function, parent: Node | None, recorded: bool) -> None:
        self.function, self.parent, self.recorded = function, parent, recorded
        self.children: dict[int, list[Node]] = defaultdict(list)
        self.outputs: list[Any] = []
        self.inputs: list[tuple[str, Any] | None] = []
        self.live_after: list[tuple[int, int]] = []  # (depth, index) of the path's outputs alive after recording
        self.graph: Any = None

    def path(self) -> list[Node]:
        """``_path_from_root``."""
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent  # type: ignore[assignment]
        return nodes[::-1]

    def path_live(self) -> Iterator[Any]:
        """``path_live_weakrefs``: the path's outputs still alive."""
        for node in self.path():
            yield from (b for b in node.outputs if b is not None and b.ptr)

    def all_outputs_are_dead(self) -> bool:
        """A warm-up node: no output of its path alive; a recorded one: none of the path's
        outputs that were alive after its recording (``live_indices_after_graph``) is alive in
        the path's latest run."""
        if not self.recorded:
            return not any(True for _ in self.path_live())
        path = self.path()
        return not any(path[depth].outputs[j] is not None and path[depth].outputs[j].ptr
                       for depth, j in self.live_after)


class Trees:
    """The run's cudagraph trees: one `TreeManager` per device, made at its first call."""

    def __init__(self, sim: Any, say: Callable[[str], None]) -> None:
        self.sim, self.say = sim, say
        self.managers: dict[int, TreeManager] = {}
        self.ids = itertools.count()

    def cudagraphify(self, model: Callable[[list[Any]], Any], static: list[int], mode: str,
                     device_index: int) -> Callable[[list[Any]], Any]:
        """``compile_fx.cudagraphify`` of one partition: its calls run in the device's tree, one
        tree function per set of sizes among its inputs (``cudagraphify_impl``'s ``fn_cache``,
        keyed by the int inputs: a graph with symbolic sizes records each size on its own), made
        at its first call."""
        functions: dict[tuple[int, ...], Function] = {}

        def run(inputs: list[Any]) -> Any:
            key = tuple(v for v in inputs if isinstance(v, int))
            function = functions.get(key)
            if function is None:
                function = functions[key] = Function(next(self.ids), model, static, mode)
            manager = self.managers.get(device_index)
            if manager is None:
                manager = self.managers[device_index] = TreeManager(device_index, self)
            return manager.run(function, inputs)

        return run


class TreeManager:
    """``CUDAGraphTreeManager`` of one device (see the module docstring)."""

    def __init__(self, device_index: int, trees: Trees) -> None:
        self.device, self.sim, self.say = device_index, trees.sim, trees.say
        self.roots: dict[int, list[Node]] = defaultdict(list)
        self.warmed: set[int] = set()
        self.current: Node | None = None
        self.state = "none"  # ExecutionState: none, warmup, recording, execution
        self.generation = -1
        self.pending_backward = False
        with torch.cuda.device(device_index):
            _memory.synchronize()
            self.stream = _memory.Stream(device_index)
            self.graph = torch.cuda.CUDAGraph()
            self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                pass

    def run(self, function: Function, inputs: list[Any]) -> Any:
        out = self._run(function, inputs)
        if function.mode == FORWARD:
            self.pending_backward = True
        elif function.mode == BACKWARD:
            self.pending_backward = False
        return out

    def _run(self, function: Function, inputs: list[Any]) -> Any:
        if self.state == "recording":
            self.try_end_curr_recording()
        if self.state == "warmup" and self.current is not None:
            self.try_end_curr_warmup()
        if function.id not in self.warmed or self.state == "warmup":
            if self.state == "execution" and self.current is not None:
                self.say(CHECKPOINT)
            return self.run_eager(function, inputs)
        children = self.roots if self.current is None else self.current.children
        if self.state != "recording":
            for child in children[function.id]:
                if self.fits(child, inputs):
                    return self.execute(child, inputs)
            if self.current is not None and function.id in self.roots:
                self.try_end_curr_execution()
                if self.current is None:
                    return self._run(function, inputs)
            self.try_end_curr_execution()
            if self.current is not None:
                self.say(CHECKPOINT)
        return self.record(function, inputs)

    # -- generations and paths ------------------------------------------------------------------
    def can_start_new_generation(self) -> bool:
        from torch._inductor.cudagraph_trees import MarkStepBox

        if self.generation == _generation():
            return False
        return MarkStepBox.mark_step_counter != 0 or not self.pending_backward

    def try_end_curr_recording(self) -> None:
        assert self.current is not None
        if self.can_start_new_generation():
            self.dealloc_current_path()
            self.current, self.state = None, "none"
        elif self.current.all_outputs_are_dead():
            self.current, self.state = None, "none"

    try_end_curr_warmup = try_end_curr_recording  # the same rule in cudagraph_trees.py, under both names

    def try_end_curr_execution(self) -> None:
        if self.current is None:
            return
        if self.can_start_new_generation() or self.current.all_outputs_are_dead():
            self.current, self.state = None, "none"

    def dealloc_current_path(self) -> None:
        """``dealloc_current_path_weakrefs``: the path's outputs still alive lose their memory
        (``_free_And_Remove_DeleterFn``: the block freed, the tensor left pointing at it)."""
        assert self.current is not None
        for block in list(self.current.path_live()):
            self.sim.release(block)

    # -- the three ways to run -------------------------------------------------------------------
    @contextmanager
    def pool_manager(self) -> Iterator[None]:
        """``_use_cuda_memory_pool_manager``: this thread's allocations to the pool, on the side stream."""
        _memory.synchronize()
        with _memory.stream(self.stream), allocating_to_pool(self.pool, self.device):
            yield

    @contextmanager
    def cublas_cleared(self) -> Iterator[None]:
        """``clear_cublas_manager``: ``torch._C._cuda_clearCublasWorkspaces()`` before and after."""
        self.sim.clear_workspaces()
        try:
            yield
        finally:
            self.sim.clear_workspaces()

    def run_eager(self, function: Function, inputs: list[Any]) -> Any:
        """``run_eager``: a warm-up (``CUDAWarmupNode.run``)."""
        self.warmed.add(function.id)
        node = Node(function, self.current, recorded=False)
        self.current, self.state, self.generation = node, "warmup", _generation()
        path = {id(b) for b in node.parent.path_live()} if node.parent is not None else set()
        outside = [b for b in map(self.sim.block_of, inputs) if b is not None and id(b) not in path]
        with torch.cuda.device(self.device), self.cublas_cleared(), self.pool_manager():
            out = function.model(inputs)
        node.outputs = self.pool_outputs(out, outside)
        return out

    def pool_outputs(self, out: Any, excluded: list[Any]) -> list[Any]:
        """The outputs' blocks the path owns: simulated tensors not over an input's storage."""
        excluded_ids = {id(b) for b in excluded}
        blocks: list[Any] = []
        for o in out:
            b = self.sim.block_of(o) if isinstance(o, torch.Tensor) else None
            blocks.append(b if b is not None and b.ptr and id(b) not in excluded_ids else None)
        return blocks

    def record(self, function: Function, inputs: list[Any]) -> Any:
        """``record_function``: a new ``CUDAGraphNode`` (see the module docstring)."""
        _memory.synchronize()
        node = Node(function, self.current, recorded=True)
        path = node.parent.path() if node.parent is not None else []
        node.inputs = [self.input_key(i, t, function, path) for i, t in enumerate(inputs)]
        with torch.cuda.device(self.device), self.pool_manager():
            recording = [torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
                         if key is None else t for t, key in zip(inputs, node.inputs)]
            for i, key in enumerate(node.inputs):
                if key is None:  # _copy_inputs_and_remove_from_src
                    recording[i].copy_(inputs[i])
                    inputs[i] = None
        inputs.clear()
        kept = self.input_blocks(recording, node.inputs)
        node.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device), self.cublas_cleared(), \
                torch.cuda.graph(node.graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = function.model(recording)
        node.outputs = self.pool_outputs(out, kept)
        if node.parent is None:
            self.roots[function.id].append(node)
        else:
            node.parent.children[function.id].append(node)
        self.current, self.state, self.generation = node, "recording", _generation()
        node.live_after = [(depth, j) for depth, n in enumerate(node.path())
                           for j, b in enumerate(n.outputs) if b is not None and b.ptr]
        return out

    def input_blocks(self, inputs: list[Any], keys: list[tuple[str, Any] | None]) -> list[Any]:
        """The blocks of the static and graph-managed inputs: an output over one is not new."""
        return [self.sim.block_of(t) for t, key in zip(inputs, keys) if key is not None and key[0] != "value"]

    def input_key(self, i: int, t: Any, function: Function, path: list[Node]) -> tuple[str, Any] | None:
        """What a recorded input is: an output of the path (``cudagraph_managed_idxs``: its depth
        and index), a static one (its address), a value, or None: copied into the pool at each call."""
        if not isinstance(t, torch.Tensor):
            return ("value", None)
        b = self.sim.block_of(t)
        for depth, node in enumerate(path):
            for j, out in enumerate(node.outputs):
                if b is not None and out is b and b.ptr:
                    return ("managed", (depth, j))
        if i in function.static:
            return ("static", t.data_ptr())
        return None

    def fits(self, node: Node, inputs: list[Any]) -> bool:
        """``check_invariants``: static inputs where they were recorded, graph-managed inputs
        the same outputs of the current path."""
        path = node.parent.path() if node.parent is not None else []
        for t, key in zip(inputs, node.inputs):
            if key is None or key[0] == "value":
                continue
            if key[0] == "static" and t.data_ptr() != key[1]:
                return False
            if key[0] == "managed":
                depth, j = key[1]
                b = self.sim.block_of(t)
                outputs = path[depth].outputs if depth < len(path) else []
                if b is None or not b.ptr or j >= len(outputs) or outputs[j] is not b:
                    return False
        return True

    def execute(self, node: Node, inputs: list[Any]) -> Any:
        """``execute_node``: a replay; nothing is allocated (`vram.run.memory.storages.SimState.replaying`)."""
        self.current, self.state, self.generation = node, "execution", _generation()
        kept = self.input_blocks(inputs, node.inputs)
        with self.sim.replaying_graph():
            out = node.function.model(inputs)
        node.outputs = self.pool_outputs(out, kept)
        return out
