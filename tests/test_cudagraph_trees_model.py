"""The model of Inductor's CUDA graph trees (`vram.run.compile.cudagraph_trees`) driven directly,
with plain functions standing for graph partitions (no compile, no triton): the allocations each
of its three ways to run makes, as torch/_inductor/cudagraph_trees.py makes them."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch._dynamo.mutation_guard import GenerationTracker  # noqa: E402

from vram.run.compile.cudagraph_trees import FORWARD, INFERENCE, Trees  # noqa: E402
from vram.run.runtime import active_sim, simulated_cuda  # noqa: E402

MiB = 1 << 20


def _partition(inputs: list) -> tuple:
    """A partition as Inductor generates it: takes its inputs list and clears it; a 4 MiB
    temporary, a 2 MiB output."""
    x, w = inputs
    inputs.clear()
    tmp = torch.empty(4 * MiB // 4, device="cuda")
    out = torch.empty(2 * MiB // 4, device="cuda")
    del tmp, x, w
    return (out,)


def _new_step() -> None:
    GenerationTracker.generation += 1  # what entering a torch.compile'd function does (eval_frame.py)


def _pool_blocks(snapshot: list, private: bool) -> int:
    return sum(b["size"] for s in snapshot if (tuple(s["segment_pool_id"]) != (0, 0)) == private
               for b in s["blocks"] if b["state"] == "active_allocated")


def test_warm_up_then_record_then_replay() -> None:
    """Call 1 (``run_eager``): the manager's empty capture makes the default generator's two
    8-byte tensors (default pool, side stream); the warm-up allocates in the tree's pool on the
    side stream. Call 2 (a new generation, ``try_end_curr_warmup`` frees the warm-up's output
    still alive, then ``record_function``): the non-static input is copied into the pool
    (``static_input``), the static one (index 1) is not. Call 3: ``check_invariants`` holds,
    the node replays: no allocation, its output charged nothing."""
    with simulated_cuda("24GiB"):
        sim = active_sim()
        trees = Trees(sim, lambda text: None)
        run = trees.cudagraphify(_partition, [1], INFERENCE, 0)
        w = torch.empty(1 * MiB // 4, device="cuda")
        x = torch.empty(1 * MiB // 4, device="cuda")
        base = torch.cuda.memory_allocated()
        _new_step()
        (out,) = run([x, w])
        snap = torch.cuda.memory_snapshot()
        assert _pool_blocks(snap, private=True) == 2 * MiB  # the output; the temporary is freed
        side = [s for s in snap if s["stream"] != 0]
        assert side and all(tuple(s["segment_pool_id"]) != (0, 0) or s["segment_type"] == "small" for s in side)
        assert torch.cuda.memory_allocated() - base == 2 * MiB + 2 * 512  # output + seed and offset
        _new_step()
        (out,) = run([x, w])  # the warm-up's output (still alive) is freed first
        assert torch.cuda.memory_allocated() - base == 2 * MiB + 2 * 512
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == 2 + 2 + 2 + 3  # then x copied, tmp, out
        peak = torch.cuda.max_memory_allocated()
        _new_step()
        count = torch.cuda.memory_stats()["allocation.all.allocated"]
        (replayed,) = run([x, w])
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == count  # a replay allocates nothing
        assert torch.cuda.max_memory_allocated() == peak
        assert replayed.shape == out.shape and replayed.device.type == "cuda"
        del out, replayed


def test_a_forward_waiting_for_its_backward_keeps_the_path() -> None:
    """``can_start_new_generation``: a new generation with a forward's backward still pending
    does not end the path (``running_forwards_with_pending_backwards``), so the forward's live
    output is not freed: a second forward warms up again as a child."""
    with simulated_cuda("24GiB"):
        trees = Trees(active_sim(), lambda text: None)
        run = trees.cudagraphify(_partition, [1], FORWARD, 0)
        w = torch.empty(1 * MiB // 4, device="cuda")
        x = torch.empty(1 * MiB // 4, device="cuda")
        _new_step()
        (first,) = run([x, w])
        _new_step()
        (second,) = run([x, w])
        manager = trees.managers[0]
        assert manager.current is not None and manager.current.parent is not None  # a child warm-up
        assert first.untyped_storage().nbytes() == 2 * MiB and torch.cuda.memory_allocated() >= 2 * 2 * MiB
        del first, second
