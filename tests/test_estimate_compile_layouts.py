"""``vram estimate --compile`` with a multi-GPU layout, each simulated rank checked event by event
against the same loop written by hand under ``vram run --nproc-per-node``: ``--ddp``
(``torch.compile(DistributedDataParallel(model))``: Dynamo's DDPOptimizer splits the graph at the
buckets, each piece compiled by vram's backend), ``--fsdp`` and HSDP (the ``fully_shard`` model
compiled) and ``--pp`` (each stage's module compiled), each with and without ``--checkpoint``;
tensor parallel (whose compiled graphs ``vram run`` runs eagerly) is refused in one line."""
from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

import vram  # noqa: E402
from test_fsdp import ENV, PROGRAMS  # noqa: E402 - after the skip: the same environment and programs
from vram.estimate.layout import Layout  # noqa: E402

INPUT = ["--input", "64x256"]


@pytest.mark.parametrize("flags, message", [
    (["--tp", "2", "--tp-plan", "tiny_stack:tp_plan"], "--compile with --tp is not modelled: tensor parallel's "
                                                       "compiled graphs take DTensors"),
    (["--fsdp", "2", "--tp", "2", "--tp-plan", "tiny_stack:tp_plan"], "--compile with --tp is not modelled"),
], ids=["tp", "fsdp-tp"])
def test_compile_with_a_layout_it_does_not_model_is_one_line(flags: list[str], message: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any model is imported or rank launched (the CLI's own entry, in this process)."""
    from vram.cli.commands import main

    assert main(["estimate", "tiny_stack:stack", *INPUT, *flags, "--compile"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and message in err, err


def test_compile_with_a_layout_it_does_not_model_is_refused_from_python() -> None:
    with pytest.raises(ValueError, match="--compile with --tp is not modelled"):
        vram.estimate("tiny_stack:stack", torch.Size([64, 256]), layout={"tp": 2, "tp_plan": "tiny_stack:tp_plan"},
                      compile="default")
    with pytest.raises(ValueError, match="--compile with --tp is not modelled"):
        Layout(tp=2, tp_plan="tiny_stack:tp_plan").check_compile("default")
    Layout(ddp=2).check_compile("default")    # modelled
    Layout(fsdp=2).check_compile("default")   # modelled
    Layout(ddp=2, fsdp=2).check_compile("default")   # modelled: HSDP
    Layout(pp=2).check_compile(None)          # not compiled: nothing to refuse
    Layout(pp=2).check_compile("default")     # modelled: each stage's module compiled, --checkpoint too


def _events(trace: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    return [(e["action"], e["addr"], e["size"]) for e in trace]


def _estimate_and_by_hand(mode: str, layout: dict[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str],
                          checkpoint: bool = False) -> tuple[Any, dict[int, Any], dict[int, list[Any]]]:
    """``vram.estimate("tiny_stack:stack", 64 x 256, layout=, compile="default")``, each simulated
    rank's recording (`distributed_programs/estimate_rank_recorded.py`), and each rank's allocation
    history of the loop by hand (`estimate_equivalent.py MODE --compile`: ``torch.compile`` of the
    wrapped model, or of a pipeline stage's module; `checkpoint`: ``checkpoint_wrapper`` around
    each block before the wrapping) under ``vram run --nproc-per-node``, whose peaks on every rank
    are those of the estimate of the rank that stands for it. Neither runs a graph eagerly (``vram
    run`` says so when it does; the estimate says what its ranks say)."""
    if find_spec("triton") is None:
        pytest.skip("needs triton (the 'compile' extra)")
    from vram.estimate import distributed

    real_launch = distributed.launch

    def recorded_ranks(spec: Any, *args: Any, command: list[str], **kwargs: Any) -> int:
        assert command[:2] == ["-m", "vram.estimate.ranks"]
        return real_launch(spec, *args, command=[str(PROGRAMS / "estimate_rank_recorded.py"), *command[2:]], **kwargs)

    monkeypatch.setattr(distributed, "launch", recorded_ranks)
    monkeypatch.chdir(PROGRAMS)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", str(Path(vram.__file__).resolve().parents[1]))   # the ranks run this vram
    monkeypatch.setenv("ESTIMATE_EVENTS", str(tmp_path / "estimate"))
    got = vram.estimate("tiny_stack:stack", torch.Size([64, 256]), layout=layout, compile="default",
                        checkpoint=checkpoint)
    assert "eagerly" not in capsys.readouterr().err
    world = Layout(**layout).world_size
    assert {r.settings["compile"] for r in got.results.values()} == {"default"}
    recorded = {r: json.loads((tmp_path / f"estimate.rank{r}.json").read_text()) for r in got.stands_for}
    done = subprocess.run([sys.executable, "-m", "vram", "run", "--nproc-per-node", str(world),
                           "estimate_equivalent.py", mode, "--world", str(world), "--compile",
                           "--history", str(tmp_path / "by_hand.pickle"), *(["--checkpoint"] if checkpoint else [])],
                          capture_output=True, text=True, env=ENV, timeout=1800, cwd=str(PROGRAMS), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "eagerly" not in done.stderr
    peaks = {(int(r), k): int(v) for r, k, v in re.findall(r"^\[rank(\d+)\]:(peak|reserved) (\d+)$", done.stdout, re.M)}
    for sim, ranks in got.stands_for.items():
        est = got.results[sim]
        assert {peaks[r, "peak"] for r in ranks} == {est.peak_allocated}
        assert {peaks[r, "reserved"] for r in ranks} == {est.peak_reserved}
    hand = {}
    for r in range(world):
        with open(tmp_path / f"by_hand.rank{r}.pickle", "rb") as f:
            hand[r] = _events(pickle.load(f)["device_traces"][r])  # noqa: S301 - written by the run above
    return got, recorded, hand


def _same_allocations(got: Any, recorded: dict[int, Any], hand: dict[int, list[Any]]) -> None:
    """Each simulated rank's allocations and frees are, in order, at the addresses and of the
    sizes, its own by hand, and every rank it stands for by hand makes the same requests (the
    replicas and even shards)."""
    batch = 64 * 256 * 4
    for sim, ranks in got.stands_for.items():
        estimated = [tuple(e) for e in recorded[sim]["events"]]
        # estimate ends by dropping the last batch; the script's snapshot is taken before its batch dies
        assert estimated[:len(hand[sim])] == hand[sim]
        assert [(a, size) for a, _, size in estimated[len(hand[sim]):]] == [("free_requested", batch),
                                                                            ("free_completed", batch)]
        for r in ranks:
            assert [(a, size) for a, _, size in hand[r]] == [(a, size) for a, _, size in hand[sim]]


@pytest.mark.slow  # compiles in the compile process: two to three minutes with the run by hand
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_ddp_compile_estimate_makes_the_allocations_of_the_run_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       checkpoint: bool) -> None:
    """``layout={"ddp": 2}``: ``torch.compile(DistributedDataParallel(model))``, as users write it
    (nanoGPT's train.py). Dynamo's DDPOptimizer split the graph at DDP's buckets
    (``_dynamo/backends/distributed.py``: parameters counted in reverse graph order, the first
    bucket closes once it holds ``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB: the last block's down
    projection, 1,049,600 bytes; the rest, 7,359,488 bytes, is under ``bucket_cap_mb``'s 25 MiB):
    two compiled pieces, each run as ``vram run`` runs it. With ``checkpoint=True`` (estimate's
    ``partial(checkpoint, forward)`` against ``checkpoint_wrapper`` by hand) each block is one
    ``tag_activation_checkpoint`` node taking its four parameters, so the first bucket is the
    last block, 2,102,272 bytes."""
    got, recorded, hand = _estimate_and_by_hand("ddp", {"ddp": 2}, tmp_path, monkeypatch, capsys, checkpoint)
    assert got.stands_for == {0: [0, 1]}
    first = 525568 * 4 if checkpoint else (256 * 1024 + 256) * 4   # the last block, or its down projection
    assert recorded[0]["ddp_buckets"] == [[4 * 525568 * 4 - first, first]]
    assert got.results[0].categories["ddp_buckets"] > 0
    _same_allocations(got, recorded, hand)


@pytest.mark.slow  # compiles in the compile process: two to three minutes with the run by hand
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_fsdp_compile_estimate_makes_the_allocations_of_the_run_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        checkpoint: bool) -> None:
    """``layout={"fsdp": 2}``: ``torch.compile`` of the model after ``fully_shard`` of each block and
    the root. FSDP2's hooks are ``_dynamo_disable``d (``_fsdp_state.py``), so Dynamo breaks the
    graph at each and the compiled graphs take the unsharded parameters, plain tensors, while
    the all-gathers and reduce-scatters run as without compile. With ``checkpoint=True``, each
    block is in ``checkpoint_wrapper`` before ``fully_shard`` on both sides (torchtitan's
    order), the wrapper's frame compiled as one ``tag_activation_checkpoint`` region."""
    got, recorded, hand = _estimate_and_by_hand("fsdp", {"fsdp": 2}, tmp_path, monkeypatch, capsys, checkpoint)
    assert got.stands_for == {0: [0, 1]} and recorded[0]["ddp_buckets"] == []
    est = got.results[0]
    assert est.categories["parameters"] == est.categories["all_gather_buffers"] == 4 * 525568 * 4 // 2
    _same_allocations(got, recorded, hand)



@pytest.mark.slow  # compiles in the compile process, then four ranks by hand: about two minutes each
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_hsdp_compile_estimate_makes_the_allocations_of_the_run_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str],
                                                                        checkpoint: bool) -> None:
    """``layout={"ddp": 2, "fsdp": 2}``: ``fully_shard`` over the 2-D (replicate, shard) mesh, then
    ``torch.compile``; the graphs are the FSDP ones (unsharded plain parameters; with
    ``checkpoint=True`` each block in ``checkpoint_wrapper`` before ``fully_shard``), the
    collectives HSDP's. One simulated rank stands for the four."""
    got, recorded, hand = _estimate_and_by_hand("hsdp", {"ddp": 2, "fsdp": 2}, tmp_path, monkeypatch, capsys,
                                                checkpoint)
    assert got.stands_for == {0: [0, 1, 2, 3]}
    assert got.results[0].categories["parameters"] == 4 * 525568 * 4 // 2
    _same_allocations(got, recorded, hand)

@pytest.mark.slow  # compiles each stage in the compile process, twice (estimate, by hand): about five minutes
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpoint"])
def test_pp_compile_estimate_makes_the_allocations_of_the_run_by_hand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      checkpoint: bool) -> None:
    """``layout={"pp": 2}``: ``pipeline()`` split at the blocks, each rank's stage module compiled
    and called by its stage (``stage.submod = torch.compile(stage.submod)`` by hand) under
    ``Schedule1F1B`` over two micro-batches. The stage's module is ``torch.export``'s: Dynamo's
    graph of it calls ATen operators (``aten.linear.default``), one graph per stage, the backward
    run by the schedule through the compiled graph's. The two stages allocate differently, so
    each is simulated, and each equals its rank by hand event by event. With ``checkpoint=True``,
    estimate's ``partial(checkpoint, forward)`` on each of the stage's blocks against
    ``checkpoint_wrapper`` by hand (after ``build_stage``, before the compile): the stage's one
    graph has a ``tag_activation_checkpoint`` region per block either way."""
    got, recorded, hand = _estimate_and_by_hand("pp", {"pp": 2}, tmp_path, monkeypatch, capsys, checkpoint)
    assert got.stands_for == {0: [0], 1: [1]}
    _same_allocations(got, recorded, hand)


def test_what_the_ranks_say_they_do_not_model_is_said_once() -> None:
    """A layout's ranks run in processes of their own, their stderr kept from the user: the
    ``vram run:`` notices among it (a compiled graph run eagerly ...) are said, once each."""
    from vram.estimate.distributed import rank_notices

    eager = "vram run: a compiled graph is not modelled (tensor subclasses): it runs eagerly"
    err = "\n".join([f"[rank0]:{eager}", "[rank0]:  warnings.warn(", f"[rank1]:{eager}",
                     "[rank1]:vram run: options= is not modelled", "vram run: from the launcher itself"])
    assert rank_notices(err) == [eager, "vram run: options= is not modelled"]


@pytest.mark.slow
def test_checkpointed_fsdp_blocks_are_compiled_in_their_wrappers_frames() -> None:
    """Compiled FSDP2 with checkpointing: the graph breaks at each block's ``_dynamo_disable``d
    FSDP2 hooks, so each block's own frame is what Dynamo compiles. After `wrap_checkpointed`
    (``checkpoint_wrapper`` before ``fully_shard``) that frame is ``CheckpointWrapper.forward``,
    traced as a ``tag_activation_checkpoint`` region; a forward replaced by
    ``partial(checkpoint, forward)`` after ``fully_shard`` is a frame of ``checkpoint`` itself,
    ``_disable_dynamo``d (torch/utils/checkpoint.py): nothing is compiled, the blocks run eagerly.
    In a process of its own, on the CPU with PyTorch's fake process group."""
    def graphs(way: str) -> list[list[str]]:
        done = subprocess.run([sys.executable, str(PROGRAMS / "compiled_checkpoint_frames.py"), way],
                              capture_output=True, text=True, env=ENV, timeout=600, cwd=str(PROGRAMS), check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    wrapped = graphs("wrapper")
    assert wrapped and all(g == ["tag_activation_checkpoint", "getitem"] for g in wrapped), wrapped
    assert graphs("partial") == []



def test_checkpoint_wrapper_goes_around_each_block_the_policy_names() -> None:
    """`wrap_checkpointed` puts each module `checkpoint=` names in non-reentrant
    ``checkpoint_wrapper`` in its parent's place (the blocks FSDP2 then shards are the wrappers)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

    from vram.estimate.trace import wrap_checkpointed

    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]), torch.nn.ReLU())
    blocks = list(model[0])
    wrap_checkpointed(model, True)
    assert [type(b) for b in model[0]] == [CheckpointWrapper] * 2
    assert [b._checkpoint_wrapped_module for b in model[0]] == blocks
    assert {b.checkpoint_impl for b in model[0]} == {CheckpointImpl.NO_REENTRANT}
    assert isinstance(model[1], torch.nn.ReLU)
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    wrap_checkpointed(flat, torch.nn.Linear)   # by class
    assert [type(m).__name__ for m in flat] == ["CheckpointWrapper", "ReLU", "CheckpointWrapper"]
